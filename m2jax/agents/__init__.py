"""Forge agents (SPEC §3): tools, the white-box agent loop, and what the
black-box agents' gateway records.

  tools.py     the tool registry and the calculator; each tool an OpenAI
               function spec plus a call that returns text or a ToolError
  sandbox.py   running untrusted Python in a limited subprocess
  whitebox.py  the white-box agent loop: context management (keep the
               last N turns, summarise), tool calls, interleaved thinking;
               every model call recorded as a training step
"""
