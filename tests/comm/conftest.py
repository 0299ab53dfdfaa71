"""tests/comm: make the spawned workers' module (comm_worlds) importable by name."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
