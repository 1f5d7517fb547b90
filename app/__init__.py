"""Micro-batching model server for PyTorch image models."""
