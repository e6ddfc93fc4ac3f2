"""The wire contract between gateway/supervisor and worker: msgspec Structs over ZeroMQ.
Built by issue #3."""
