"""An OpenAI-compatible HTTP server on the continuous-batching engine: python -m minispec.serve."""
