"""The example workflows in ComfyUI's real frontend: headless Chromium against the ComfyUI server on 127.0.0.1.

For each workflow: it loads with no missing node type and no error dialog, every widget holds the value in the
JSON, no two nodes' boxes overlap at the size the frontend gives them, and queueing it fails only on the model
files this machine does not have.  A screenshot of each goes to $PA_ARTIFACTS/comfyui-<release>/ (default
.build/artifacts), taken in the frontend that release pins.

Needs Debian's chromium and chromium-driver and the selenium package (`.ci/run` installs them); skipped with the
reason where they are missing.
"""

import glob
import json
import os
import shutil
import urllib.request

import pytest
from comfyui_support import ROOT, release
from test_comfyui_server import server  # noqa: F401  (the fixture: ComfyUI's server with this pack installed)

pytestmark = [pytest.mark.comfyui, pytest.mark.server]

WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))
ARTIFACTS_BASE = os.environ.get("PA_ARTIFACTS") or os.path.join(ROOT, ".build", "artifacts")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser(server):  # noqa: F811
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Chromium and its driver are not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=2400,1400",
              "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update",
              "--disable-sync"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(60)
    url, _ = server
    # a new user gets the template browser on first start: this user has seen it
    req = urllib.request.Request(url + "/settings/Comfy.TutorialCompleted", data=b"true", method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()
    driver.get(url)
    ready = "return !!(window.app && window.app.graph && window.LiteGraph && " \
            "window.LiteGraph.registered_node_types && window.LiteGraph.registered_node_types['PatchAttention'])"
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 90).until(lambda d: d.execute_script(ready))
    yield driver
    driver.quit()


LOAD = """
const [wf, done] = [arguments[0], arguments[arguments.length - 1]];
(async () => {
  try {
    if (window.app.clean) window.app.clean();  // the previous workflow's queue errors would outline this one's nodes
    await window.app.loadGraphData(wf);
    await new Promise(r => setTimeout(r, 500));
    const reg = window.LiteGraph.registered_node_types;
    const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
    const nodes = window.app.graph._nodes.map(n => ({
      id: n.id, type: n.type, registered: !!reg[n.type], built: !!n.constructor.comfyClass,
      box: [n.pos[0], n.pos[1] - title, n.size[0], n.size[1] + title],
      values: (n.widgets || []).map(w => w.value),
      inputs: (n.inputs || []).map(i => [i.name, i.label || null])}));
    const dialogs = [...document.querySelectorAll('.p-dialog, .comfy-modal')]
      .filter(d => d.offsetParent !== null).map(d => d.innerText.slice(0, 300));
    window.app.canvas.ds.scale = 0.62; window.app.canvas.ds.offset = [10, 10];
    window.app.graph.setDirtyCanvas(true, true);
    done({nodes, dialogs});
  } catch (e) { done({error: String(e)}); }
})();
"""

def overlaps(a, b):
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_workflow_in_the_real_frontend(browser, path):
    wf = json.load(open(path))
    name = os.path.splitext(os.path.basename(path))[0]
    res = browser.execute_async_script(LOAD, wf)
    shots = os.path.join(ARTIFACTS_BASE, f"comfyui-{release()}")  # one folder per ComfyUI release (and its frontend)
    os.makedirs(shots, exist_ok=True)
    browser.save_screenshot(os.path.join(shots, f"{name}.png"))
    assert "error" not in res, res.get("error")
    assert not res["dialogs"], f"dialog after loading: {res['dialogs']}"
    missing = [n["type"] for n in res["nodes"] if not n["registered"]]
    assert not missing, f"node types the frontend does not know: {missing}"
    # node ids: numbers in the JSON and in frontend 1.27, strings in frontend 1.49 (ComfyUI 0.33)
    want = {str(n["id"]): n["widgets_values"] for n in wf["nodes"]}
    for n in res["nodes"]:
        nid = str(n["id"])
        assert n["values"] == want[nid], f"{n['type']} #{nid}: widgets {n['values']} != JSON {want[nid]}"
    # the settings input shows the name the settings nodes' outputs have (its id in saved workflows stays)
    for n in res["nodes"]:
        for slot, label in n["inputs"]:
            if n["type"] == "PatchAttention" and slot == "sparge_settings":
                assert label == "sparse_settings", n["inputs"]
    boxes = res["nodes"]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not overlaps(a["box"], b["box"]), f"{a['type']} #{a['id']} overlaps {b['type']} #{b['id']}: {a['box']} {b['box']}"
    # every node is a real node (ComfyUI 0.3.64's frontend builds loaders as red placeholders when ComfyUI's optional
    # requirements are missing: its model-to-node store then throws on the absent upscale-model loader)
    placeholders = {n["type"] for n in res["nodes"] if not n["built"]} - FRONTEND_ONLY
    assert not placeholders, f"nodes the frontend could not build: {placeholders}"
    # queueing from the frontend: the server refuses what needs model files this machine does not have, and nothing
    # else (it still queues the rest: Attention Backends Info, which needs no model, runs and shows its report)
    q = browser.execute_async_script(QUEUE)
    assert "error" not in q, q.get("error")
    body = q["body"]
    assert q["status"] in (200, 400) and body.get("node_errors"), body
    for nid, err in body["node_errors"].items():
        for e in err["errors"]:
            field = e.get("extra_info", {}).get("input_name", "")
            missing_model = e["type"] == "value_not_in_list" and (field.endswith("_name") or field.startswith("clip_name"))
            missing_profile = field == "profile" and "is not in models/sparge_profiles" in e.get("details", "")
            assert missing_model or missing_profile, f"node {nid} ({err.get('class_type')}): {e}"


QUEUE = """
const done = arguments[arguments.length - 1];
(async () => {
  try {
    const p = await window.app.graphToPrompt();
    const r = await fetch('/prompt', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                      body: JSON.stringify({prompt: p.output, client_id: 'pa-browser-test'})});
    done({status: r.status, body: await r.json()});
  } catch (e) { done({error: String(e)}); }
})();
"""

FRONTEND_ONLY = {"Note"}


TEMPLATES = """
const done = arguments[arguments.length - 1];
(async () => {
  try {
    // what the template browser does: the list of custom nodes' templates, then <module>/<name>.json and .jpg
    const list = await (await fetch('/api/workflow_templates')).json();
    const names = list['ComfyUI-PatchAttention'] || [];
    const got = {};
    for (const name of names) {
      const wf = await fetch(`/api/workflow_templates/ComfyUI-PatchAttention/${name}.json`);
      const jpg = await fetch(`/api/workflow_templates/ComfyUI-PatchAttention/${name}.jpg`);
      got[name] = {json: wf.status, nodes: wf.ok ? (await wf.json()).nodes.length : 0, jpg: jpg.status,
                   jpgType: jpg.headers.get('content-type')};
    }
    done({names, got});
  } catch (e) { done({error: String(e)}); }
})();
"""


def test_templates_are_listed_and_served_under_their_titles(browser):
    """Frontend 1.49 titles a custom node pack's template card with its file name: the files carry human titles, and
    the server serves them (and their thumbnails) at the URLs the frontend builds from those names."""
    res = browser.execute_async_script(TEMPLATES)
    assert "error" not in res, res.get("error")
    want = {os.path.splitext(os.path.basename(p))[0] for p in WORKFLOWS}
    assert set(res["names"]) == want
    for name, r in res["got"].items():
        assert r["json"] == 200 and r["nodes"] > 5 and r["jpg"] == 200 and r["jpgType"].startswith("image/jpeg"), (name, r)


OLD_UI = os.path.join(ROOT, "tests", "fixture_workflows", "wan21_sparge_tuning_saved_before_sparse_settings.json")

OLD = """
const [wf, done] = [arguments[0], arguments[arguments.length - 1]];
(async () => {
  try {
    await window.app.loadGraphData(wf);
    await new Promise(r => setTimeout(r, 500));
    const g = window.app.graph;
    // what the note asks for: un-mute group 2 (the settings, Patch Attention, sampler), mute group 1 (the tuning run)
    for (const n of g._nodes) { if ([13, 14, 15, 16, 17].includes(Number(n.id))) n.mode = 0;
                                if ([9, 10, 11, 12].includes(Number(n.id))) n.mode = 2; }
    const patch = g._nodes.find(n => Number(n.id) === 14);
    const slot = patch.inputs.find(i => i.name === 'sparge_settings');
    const p = await window.app.graphToPrompt();
    const r = await fetch('/prompt', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                      body: JSON.stringify({prompt: p.output, client_id: 'pa-browser-test'})});
    const dialogs = [...document.querySelectorAll('.p-dialog, .comfy-modal')]
      .filter(d => d.offsetParent !== null).map(d => d.innerText.slice(0, 300));
    done({slot: {link: slot.link, label: slot.label || slot.localized_name || null, type: slot.type},
          input: p.output['14'] ? p.output['14'].inputs.sparge_settings : null, status: r.status, body: await r.json(),
          dialogs});
  } catch (e) { done({error: String(e)}); }
})();
"""


def test_a_workflow_saved_before_the_settings_type_was_renamed_loads_and_queues(browser):
    """The settings type was SPARGE_SETTINGS; a workflow saved then keeps its link from SpargeAttn Settings to Patch
    Attention, and the server accepts the prompt (refusing only the model and profile files this machine lacks)."""
    res = browser.execute_async_script(OLD, json.load(open(OLD_UI)))
    assert "error" not in res, res.get("error")
    assert not res["dialogs"], res["dialogs"]
    assert res["slot"]["link"] is not None and res["input"] == ["13", 0], res
    body = res["body"]
    for nid, err in body.get("node_errors", {}).items():
        for e in err["errors"]:
            field = e.get("extra_info", {}).get("input_name", "")
            missing_model = e["type"] == "value_not_in_list" and (field.endswith("_name") or field.startswith("clip_name"))
            missing_profile = field == "profile" and "is not in models/sparge_profiles" in e.get("details", "")
            assert missing_model or missing_profile, f"node {nid} ({err.get('class_type')}): {e}"
    print("sparge_settings slot in the frontend:", res["slot"])
