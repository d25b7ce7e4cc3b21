"""Splits docs/nodes.md into web/docs/<node id>.md, the per-node help that ComfyUI's web UI shows for
custom nodes (node library > info). Run after editing docs/nodes.md; a test checks they agree.

    python tools/comfyui/node_docs.py
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "docs" / "nodes.md"
TARGET = ROOT / "web" / "docs"


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (FastAR\w+)\n", text, flags=re.M)
    return {parts[i]: f"# {parts[i]}\n" + parts[i + 1].rstrip() + "\n" for i in range(1, len(parts), 2)}


def main() -> int:
    TARGET.mkdir(parents=True, exist_ok=True)
    for node, body in sections(SOURCE.read_text()).items():
        (TARGET / f"{node}.md").write_text(body)
        print(f"wrote web/docs/{node}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
