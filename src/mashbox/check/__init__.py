"""`mashbox check URL`: seeded sampling's reproducibility and the protocols' shapes, checked
against any running OpenAI/Anthropic-compatible server (mashbox, llama-server, vLLM...).

Light on purpose: httpx and the standard library only, never torch or mashbox's server.
"""
