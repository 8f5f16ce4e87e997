"""Pallas kernels for m2jax, each with a pure-jnp reference beside it."""
