"""Speculative decoding with the model's MTP head (`EngineConfig.speculative = "mtp"`).

Each step a speculating request feeds its pending token and the K tokens its MTP head drafted
into one target forward (`verify_call`), keeps the drafts the target agrees with (greedy match,
or rejection sampling that keeps the target distribution: `acceptance`), and rolls its KDA state
back to the last kept position from per-position checkpoints taken during that forward
(`checkpoint_view`). The MTP head then catches up over the positions computed this step and
drafts K tokens for the next one (`mtp_drafter`). `runner.SpeculativeRunner` drives it;
`step_result` turns one verification into the engine's usual one-token results; `tracker` keeps
acceptance per draft position and switches a request off when its drafts keep failing (trying
again after a doubling wait); `batch_rule` runs a step of `spec_max_batch` or more requests as
plain decode, keeping the MTP layer current for when drafting resumes, and `step_costs` runs a
smaller batch plainly too where the engine measured that speculating there costs more. With
compiled decode, the verification and the MTP layer's calls run through compiled regions of their
own (`compiled_verify`, `compiled_draft`).
"""
