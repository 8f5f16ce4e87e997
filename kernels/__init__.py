"""Pallas kernels for m2jax, each with a pure-jnp reference beside it.

One public entry point per op, its reference and one module per backend:
  gmm.py              grouped matmuls (gmm, tgmm, gmm_swiglu): gmm_ref.py,
                      gmm_mosaic.py, gmm_triton.py
  tree_attention.py   tree attention and its reference:
                      tree_attention_mosaic.py, tree_attention_triton.py
  paged_attention.py  decode attention over a paged KV cache and its
                      reference: paged_attention_mosaic.py,
                      paged_attention_triton.py
  mosaic_pipeline.py  the warp-specialised skeleton of the Mosaic kernels
Backends are named after their lowering, the same in both ops: "xla" (the
reference), "mosaic" (Mosaic GPU, Hopper), "triton" (portable Pallas), and
"auto". Benchmarks live in benchmarks/, outside this package.
"""
