"""Federated strategies beyond Flower's own.

edgefl runs Flower's strategies (FedAvg, FedProx, FedAdam, FedMedian, ...) by their Hydra
``_target_`` in conf/strategy/; variants of our own go here, one per file.
"""
