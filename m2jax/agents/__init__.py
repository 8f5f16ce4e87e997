"""Forge agents (SPEC §3): tools, the white-box agent loop, and what the
black-box agents' gateway records.

  tools.py     the tool registry and the tools: an exact calculator, Python
               run in the sandbox, listing and reading one directory's
               files; each an OpenAI function spec plus a call that returns
               text or raises a ToolError
  sandbox.py   running untrusted Python in a confined subprocess (kernel
               namespaces, landlock, seccomp, rlimits, an audit hook)
  whitebox.py  the white-box agent loop: context management (keep the
               last N turns, summarise), tool calls, interleaved thinking;
               every model call recorded as a training step
"""
