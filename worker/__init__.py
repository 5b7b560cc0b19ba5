"""The gRPC worker: model, attention backends, scheduler/engine and server (installed as radixcache.worker)."""
