"""The engine core: LLMEngine (`llm_engine.py`) steps requests through the scheduler (policy), the
cache (memory: blocks, state slots, prefix reuse, the per-call view) and the runner (the model);
sampling, detokenizing and outputs follow. `compiled_decode.py` owns everything torch.compile needs
to know. `async_engine.py` drives one LLMEngine from its own thread for concurrent callers (the
HTTP server, or any other front end), which is why it lives here and not in `api/`."""
