"""The one-command demo: start the real ComfyUI with the FastAR pack and the bundled demo models, run the
demo workflow (workflows/fastar_demo_sjd.json) once through its API, write the images and the decode
statistics, and say which URL to open. Run by tools/comfyui/demo.sh after the set-up.

    .comfyui/venv/bin/python tools/comfyui/demo.py [--out DIR] [--port N] [--keep-running]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import harness

DEMO_FILES = ("demo_c2i.safetensors", "demo_vq.safetensors")
WORKFLOW = harness.ROOT / "workflows" / "fastar_demo_sjd.json"
DEFAULT_PORT = 8188  # ComfyUI's usual port


def port_or_free(port: int) -> int:
    if port:
        return port
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEFAULT_PORT))
            return DEFAULT_PORT
        except OSError:
            return harness.free_port()


def screenshot(server: harness.Server, path: Path) -> None:
    import subprocess

    from PIL import Image

    server.free_memory()  # a real run with its live preview, not a cached one
    raw = path.with_name(path.stem + "_full.png")
    subprocess.run([sys.executable, str(Path(__file__).with_name("browser.py")), "run", "--url", server.url,
                    "--workflow", str(WORKFLOW), "--screenshot", str(raw)], check=True)
    image = Image.open(raw).convert("RGB")
    image = image.crop((56, 72, image.width, image.height))  # no banner, tabs or side bar
    image.thumbnail((1200, 1200))
    image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    raw.unlink()
    raw.with_name(raw.stem + "_loaded.png").unlink(missing_ok=True)
    print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=harness.ROOT / "out" / "comfyui_demo",
                        help="where the images and stats go (default: out/comfyui_demo)")
    parser.add_argument("--port", type=int, default=0, help=f"server port (default: {DEFAULT_PORT} if free)")
    parser.add_argument("--models", type=Path, action="append", default=[],
                        help="an extra fastar model folder (as a fastar: path in extra_model_paths.yaml)")
    parser.add_argument("--screenshot", type=Path,
                        help="also run the workflow in headless Chromium and save a screenshot of the canvas "
                             "(PNG, 1200 px wide: docs/comfyui_workflow.png is made this way)")
    parser.add_argument("--keep-running", action="store_true",
                        help="keep ComfyUI running after the demo (stop it with Ctrl-C)")
    args = parser.parse_args(argv)

    folders = [harness.ROOT / "demo", *args.models]
    missing = [name for name in DEMO_FILES if not any((folder / name).exists() for folder in folders)]
    if missing:
        print(f"error: the bundled demo weights are missing ({', '.join(missing)} in demo/): build them with "
              "python -m fastar.demo_recipes.train_vq && python -m fastar.demo_recipes.train_ar (see README)", file=sys.stderr)
        return 2
    problem = harness.installed()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    server = harness.Server(harness.HOME / "base", model_folders=[m.resolve() for m in args.models],
                            port=port_or_free(args.port), extra_args=["--preview-method", "auto"])
    print("starting ComfyUI with the FastAR pack ...", file=sys.stderr)
    for stop in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: leave through the finally that stops the server
        signal.signal(stop, lambda number, _frame: sys.exit(128 + number))
    started = time.monotonic()
    server.start()
    try:
        print(f"ComfyUI is up in {time.monotonic() - started:.0f} s: {server.url}", file=sys.stderr)
        prompt = harness.ui_to_api(harness.load_workflow(WORKFLOW), server.object_info())
        started = time.monotonic()
        entry = server.run(prompt, timeout=900)
        error = harness.execution_error(entry)
        if error:
            print(f"error: {error['node_type']}: {error['exception_message']}", file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        written = []
        for i, image in enumerate(harness.output_images(entry)):
            if image.get("type") != "output":
                continue  # previews (the acceptance map) stay in ComfyUI's temp folder
            path = args.out / f"demo_{len(written)}.png"
            path.write_bytes(server.fetch(image))
            written.append(path)
        stats = [data for out in entry["outputs"].values() for data in out.get("fastar_stats", [])]
        texts = [text for out in entry["outputs"].values() for text in out.get("text", [])]
        (args.out / "stats.json").write_text(json.dumps(stats[0] if len(stats) == 1 else stats, indent=1))
        print(f"ran {WORKFLOW.relative_to(harness.ROOT)} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        print("\n".join(texts), file=sys.stderr)
        print(f"wrote {len(written)} image(s) and stats.json to {args.out}", file=sys.stderr)
        if args.screenshot:
            screenshot(server, args.screenshot)
        if args.keep_running:
            print(f"\nOpen {server.url} in a browser: Templates > FastAR > fastar_demo_sjd, then Run.\n"
                  "Press Ctrl-C to stop ComfyUI.", file=sys.stderr)
            try:
                while server.process.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        else:
            print(f"\nComfyUI has stopped. To use the web UI, run: bash tools/comfyui/demo.sh --keep-running\n"
                  f"and open {server.url} (Templates > FastAR > fastar_demo_sjd, then Run).", file=sys.stderr)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
