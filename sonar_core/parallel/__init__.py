"""Data parallelism: several engine replicas behind one server (tensor parallelism, one model
split over ranks, is the engine's own: :mod:`sonar_core.engine.tensor_parallel`)."""
