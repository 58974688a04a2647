"""A module whose import ends the process without a word (``os._exit``): the preloaded fork
server dies before it can report; the owner must say so, not hang (tests/test_forkserver.py)."""

import os

os._exit(5)
