"""Tests run offline on the CPU: the tiny model is built into a per-session cache and
nothing may reach the Hugging Face Hub."""

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NANOPO_CACHE", os.path.join(tempfile.gettempdir(), "nanopo-test-cache"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
