"""The OpenAI-compatible HTTP server over an AsyncLLMEngine: the FastAPI app (`server.py`), request
schemas and sampling params, OpenAI-style errors, response formatting, Prometheus metrics, the
streaming generation loop, a server thread for tests and benches, and the chat template."""
