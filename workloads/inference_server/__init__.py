"""The inference server: Ray Serve LLM (vLLM) behind a typed catalogue, API keys and request limits.

``catalog`` depends on pydantic alone; ``app`` (the Serve application builder)
imports Ray and is loaded only where Ray is installed.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
