"""Tensor parallelism inside the torch driver: sharding a checkpoint and its adapters, the rank
processes and their collectives, and the driver that runs one operation on every rank."""
