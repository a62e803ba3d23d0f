"""Top tier: ComfyUI's server on 127.0.0.1 (CPU) with this pack installed runs an API workflow using Patch Attention."""

import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from comfyui_support import FLUX_CFG, ROOT, comfy

pytestmark = [pytest.mark.comfyui, pytest.mark.server]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url, data):
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = comfy()
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "custom_nodes").mkdir()
    os.symlink(ROOT, base / "custom_nodes" / "ComfyUI-PatchAttention")
    os.symlink(os.path.join(ROOT, "tests", "fixture_nodes"), base / "custom_nodes" / "pa_test_fixtures")
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    # a tiny random-weight Flux written to the temp models folder
    from comfyui_support import tiny_flux
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in tiny_flux().model.diffusion_model.state_dict().items()}
    save_file(sd, str(models / "tiny_flux.safetensors"), metadata={"flux_config": json.dumps(FLUX_CFG)})
    from comfyui_support import tiny_vae_state_dict

    (base / "models" / "vae").mkdir()
    save_file(tiny_vae_state_dict(16), str(base / "models" / "vae" / "tiny_taesd_flux.safetensors"))
    port = free_port()
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
         "--disable-auto-launch"],
        cwd=path, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("ComfyUI exited during start:\n" + (base / "server.log").read_text()[-3000:])
        try:
            get(url + "/object_info/PatchAttention", timeout=2)
            break
        except Exception:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("ComfyUI did not answer within 120 s:\n" + (base / "server.log").read_text()[-3000:])
    yield url, base
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_object_info_lists_the_nodes(server):
    url, _ = server
    info = get(url + "/object_info/PatchAttention")["PatchAttention"]
    assert info["display_name"] == "Patch Attention"
    spec = info["input"]["required"]["backend"]
    options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]  # classic or V3 combo
    assert options[:2] == ["auto", "disabled"] and "sage_fp8_sm90" in options
    assert "AttentionBackendsInfo" in get(url + "/object_info/AttentionBackendsInfo")
    templates = get(url + "/api/workflow_templates")
    assert set(templates.get("ComfyUI-PatchAttention", [])) >= {"Flux.1 dev image 1024px", "SD 1.5 image 512px",
                                                                "SDXL image 1024px", "Wan 2.1 video 480p 81 frames"}


def run_prompt(url, base, prompt, timeout=180):
    pid = post(url + "/prompt", {"prompt": prompt, "client_id": "pa-test"})["prompt_id"]
    deadline = time.time() + timeout
    while time.time() < deadline:
        hist = get(url + f"/history/{pid}")
        if pid in hist and hist[pid].get("status", {}).get("completed"):
            return hist[pid]
        if pid in hist and hist[pid].get("status", {}).get("status_str") == "error":
            pytest.fail(json.dumps(hist[pid]["status"], indent=1)[-3000:])
        time.sleep(0.5)
    pytest.fail(f"prompt did not finish in {timeout} s:\n" + (base / "server.log").read_text()[-3000:])


def test_end_to_end_benchmark_node_returns_its_report_and_two_images(server):
    """Through ComfyUI's executor: the report, the chart and (with a VAE from VAELoader) the frames, each saved by
    Save Image; without a VAE the frames output is still an image."""
    url, base = server
    bench = {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0], "steps": 1,
             "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "seed": 0, "rows": "unpatched, sdpa_math",
             "peers": False, "compile": False}
    prompt = {
        "1": {"class_type": "PATestTinyFluxLoader", "inputs": {"unet_name": "tiny_flux.safetensors"}},
        "2": {"class_type": "PATestConditioning", "inputs": {"seed": 1, "tokens": 8, "context_dim": 32, "pooled_dim": 32}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}},
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_taesd_flux.safetensors"}},
        "5": {"class_type": "AttentionBenchmarkE2E", "inputs": {**bench, "vae": ["4", 0]}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 1], "filename_prefix": "pa_chart"}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["5", 2], "filename_prefix": "pa_frames"}},
        "8": {"class_type": "AttentionBenchmarkE2E", "inputs": {**bench, "seed": 1}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 2], "filename_prefix": "pa_novae"}},
    }
    entry = run_prompt(url, base, prompt)
    assert entry["status"]["status_str"] == "success"
    assert "| Flux | sdpa_math |" in entry["outputs"]["5"]["text"][0]  # the report, shown on the node
    from PIL import Image

    sizes = {}
    for node, prefix in (("6", "pa_chart"), ("7", "pa_frames"), ("9", "pa_novae")):
        (saved,) = entry["outputs"][node]["images"]
        assert saved["filename"].startswith(prefix)
        sizes[prefix] = Image.open(base / "output" / saved.get("subfolder", "") / saved["filename"]).size
    assert sizes["pa_chart"][0] >= 600 and sizes["pa_chart"][1] >= 400
    assert sizes["pa_frames"][0] >= 2 * 128 and sizes["pa_frames"][1] >= 2 * 128  # frame + heatmap per row, two rows
    assert sizes["pa_novae"][1] < 200  # a small image that says no VAE was given


def test_prompt_with_patch_attention_succeeds(server):
    url, base = server
    prompt = {
        "1": {"class_type": "PATestTinyFluxLoader", "inputs": {"unet_name": "tiny_flux.safetensors"}},
        "2": {"class_type": "PatchAttention", "inputs": {"model": ["1", 0], "backend": "sdpa_math", "fallback": True,
                                                         "start_percent": 0.0, "end_percent": 1.0, "dense_layers": "",
                                                         "log_stats": True}},
        "3": {"class_type": "PATestConditioning", "inputs": {"seed": 1, "tokens": 8, "context_dim": 32, "pooled_dim": 32}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": 3, "steps": 3, "cfg": 1.0, "sampler_name": "euler",
                                                   "scheduler": "simple", "positive": ["3", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "pa_test"}},
        "7": {"class_type": "AttentionBackendsInfo", "inputs": {}},
    }
    pid = post(url + "/prompt", {"prompt": prompt, "client_id": "pa-test"})["prompt_id"]
    deadline = time.time() + 120
    while time.time() < deadline:
        hist = get(url + f"/history/{pid}")
        if pid in hist and hist[pid].get("status", {}).get("completed"):
            break
        if pid in hist and hist[pid].get("status", {}).get("status_str") == "error":
            pytest.fail(json.dumps(hist[pid]["status"], indent=1)[-3000:])
        time.sleep(0.5)
    else:
        pytest.fail("prompt did not finish in 120 s:\n" + (base / "server.log").read_text()[-3000:])
    entry = hist[pid]
    assert entry["status"]["status_str"] == "success"
    assert "sdpa" in entry["outputs"]["7"]["text"][0]
    assert list((base / "output").rglob("pa_test*.latent"))
    log = (base / "server.log").read_text()
    assert "Patch Attention (sdpa_math)" in log and "sdpa_math" in log and "6 calls" in log


def finished_prompt(url, base, prompt, timeout=120):
    """Queue ``prompt``; its history entry once it finished or failed (:func:`run_prompt` fails the test on an error)."""
    pid = post(url + "/prompt", {"prompt": prompt, "client_id": "pa-test"})["prompt_id"]
    deadline = time.time() + timeout
    while time.time() < deadline:
        hist = get(url + f"/history/{pid}")
        if pid in hist and (hist[pid].get("status", {}).get("completed")
                            or hist[pid].get("status", {}).get("status_str") == "error"):
            return hist[pid]
        time.sleep(0.5)
    pytest.fail("prompt did not finish in time:\n" + (base / "server.log").read_text()[-3000:])


@pytest.mark.parametrize("input_id", ["sparse_settings", "sparge_settings"])
def test_a_prompt_with_the_settings_input_s_current_or_earlier_id_reaches_patch_attention(server, input_id):
    """Patch Attention's settings input was saved as sparge_settings before it was renamed sparse_settings: ComfyUI
    hands an API-format workflow's link to the node under whichever id it has, and the node takes both. The settings
    arrive: Patch Attention refuses settings for another kernel than its backend, naming itself."""
    url, base = server
    prompt = {
        "1": {"class_type": "PATestTinyFluxLoader", "inputs": {"unet_name": "tiny_flux.safetensors"}},
        "2": {"class_type": "SpargeAttnSettings", "inputs": {"variant": "sparge", "simthreshd1": 0.6, "cdfthreshd": 0.98,
                                                              "pvthreshd": 50.0}},
        "3": {"class_type": "PatchAttention", "inputs": {"model": ["1", 0], "backend": "sdpa_math", "fallback": True,
                                                         "start_percent": 0.0, "end_percent": 1.0, "dense_layers": "",
                                                         "log_stats": False, input_id: ["2", 0]}},
        "4": {"class_type": "PATestConditioning", "inputs": {"seed": 1, "tokens": 8, "context_dim": 32, "pooled_dim": 32}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["3", 0], "seed": 3, "steps": 1, "cfg": 1.0, "sampler_name": "euler",
                                                   "scheduler": "simple", "positive": ["4", 0], "negative": ["4", 0],
                                                   "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "pa_rename"}},
    }
    entry = finished_prompt(url, base, prompt)
    status = entry["status"]
    assert status["status_str"] == "error", status
    err = next(m[1] for m in status["messages"] if m[0] == "execution_error")
    assert err["node_type"] == "PatchAttention"
    assert err["exception_message"].startswith("Patch Attention: the sparse-attention settings are for sparge, the "
                                               "backend is sdpa_math"), err["exception_message"]
    # and with the settings' own kernel the same prompt runs (on the CPU SpargeAttn is absent: the fastest exact kernel)
    prompt["3"]["inputs"]["backend"] = "sparge"
    assert finished_prompt(url, base, prompt)["status"]["status_str"] == "success"


VIDEO_TEMPLATES = sorted(p for p in glob.glob(os.path.join(ROOT, "workflows", "api", "*.json"))
                         if any(n["class_type"] == "SaveVideo" for n in json.load(open(p)).values()))


def save_part(prompt: dict) -> tuple:
    """(Save Video's id, a prompt of ``prompt``'s Create Video and Save Video as they are, on 9 frames of Empty Image)."""
    (sid, save), = [(k, n) for k, n in prompt.items() if n["class_type"] == "SaveVideo"]
    cid = save["inputs"]["video"][0]
    create = prompt[cid]
    frames = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 9, "color": 0x3366AA}}
    return sid, {"frames": frames, cid: {**create, "inputs": {**create["inputs"], "images": ["frames", 0]}}, sid: save}


def saved_video(base, saved: dict) -> tuple:
    """(container, codec, frame rate, frames) of a file a Save Video node reports in its history ``saved`` entry."""
    import av

    with av.open(str(base / "output" / saved["subfolder"] / saved["filename"])) as f:
        stream = f.streams.video[0]
        return f.format.name, stream.codec_context.name, stream.average_rate, sum(1 for _ in f.decode(stream))


@pytest.mark.parametrize("path", VIDEO_TEMPLATES, ids=os.path.basename)
def test_a_video_template_s_api_file_saves_an_h264_mp4(server, path):
    """workflows/api's Save Video as written (format mp4 and codec h264: ComfyUI 0.3.64's inputs, which 0.33 takes
    through the legacy codec input it keeps for them) and its Create Video, run on this release: an MP4 of H.264 at
    16 frames per second under output/video/."""
    url, base = server
    sid, prompt = save_part(json.load(open(path)))
    (saved,) = run_prompt(url, base, prompt, timeout=120)["outputs"][sid]["images"]
    assert saved["subfolder"] == "video" and saved["filename"].endswith(".mp4"), saved
    container, codec, rate, frames = saved_video(base, saved)
    assert "mp4" in container and codec == "h264" and rate == 16 and frames == 9, (container, codec, rate, frames)
