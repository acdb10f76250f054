"""Images for the vision tower: decoding with Pillow, resizing to the patch grid within a token
budget, normalisation (`preprocess`); needs only `deltamoe.config` (below `model` and `serve`)."""
