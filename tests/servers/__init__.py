"""Local stand-ins for remote services, for tests: a Hugging Face Hub (``hub_server``) and S3 (``moto_server``).

Both listen on 127.0.0.1 only. ``fixtures`` wraps them as pytest fixtures; import the ones a test
module needs from ``servers.fixtures``.
"""
