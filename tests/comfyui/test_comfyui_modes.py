"""ComfyUI's other memory and cache modes: with --disable-smart-memory (models offloaded after every use)
and --cache-none (every node, loaders included, runs again each time) the workflows still run, drafters
(loaded and offloaded beside their model) included. (--lowvram and GPU runs need a CUDA device; this
machine has none.)"""
from comfyui_helpers import workflow_prompt

import harness


def test_workflows_run_with_offloading_and_no_cache(comfy_env, models, drafters, tmp_path):
    with harness.Server(tmp_path / "base", model_folders=[models], drafter_folders=[drafters],
                        extra_args=["--disable-smart-memory", "--cache-none"]) as server:
        info = server.object_info()
        for name in ("fastar_demo_compare_ar_sjd_gsd", "fastar_llamagen_t2i", "fastar_demo_sjd",
                     "fastar_demo_lantern_compare", "fastar_llamagen_t2i_lantern"):
            entry = server.run(workflow_prompt(name, info))
            assert entry["status"]["status_str"] == "success", (name, harness.execution_error(entry))
            assert harness.output_images(entry)
