"""Power-loss tests: a recording FUSE file system, crash states computed from its log, and checks
(docs/RELIABILITY.md)."""
