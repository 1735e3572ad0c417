"""llaisys's OpenAI-compatible HTTP server (FastAPI + uvicorn): `llaisys serve`, or create_app(engine)
to mount it yourself. Needs the `serve` extra: pip install 'llaisys[serve]'."""
