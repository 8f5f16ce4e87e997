"""The OpenAI-compatible server over the generation engine.

  app.py        FastAPI routes (/v1/models, /v1/completions,
                /v1/chat/completions), the API key, errors, `serve`
  loop.py       EngineLoop: the one thread that owns the Engine; requests of
                all connections batch together; the policy version
  protocol.py   request / response shapes, extensions, OpenAI's error shape
  streaming.py  what of a growing sample may be streamed (stop strings,
                UTF-8, chat markers) and chat deltas

Started by `python -m experiments.serve`; see the README's "Serving".
"""
