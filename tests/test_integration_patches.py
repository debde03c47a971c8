"""Importing an integration changes nothing in transformers; register() registers the attention
name only, enable() makes every other process-wide change; patched() lists them and disable()
puts every original back.

Each check runs in a fresh interpreter: it snapshots every attribute of every loaded
transformers module and class (and the attention interfaces' mappings) before usp-hal is
imported, and compares by identity after the imports, after register() and after disable()."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

# the modeling modules whose functions the covered hybrid layers route (loaded before the first
# snapshot, so that a change to them at import would be seen); the test checks that this list
# is usp_hal.integrations.sequence_mixers.COVERED_LAYERS' modules
MODELING = ["transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5",
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "transformers.models.lfm2.modeling_lfm2",
            "transformers.models.nemotron_h.modeling_nemotron_h",
            "transformers.models.kimi_linear.modeling_kimi_linear"]

SNAPSHOT = r'''
import importlib, json, sys, types
from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
for m in MODELING:
    importlib.import_module(m)
INTERFACES = (AttentionInterface, AttentionMaskInterface)


def snapshot():
    """label -> object: every module's attributes, every class's own attributes (classes
    defined in a transformers module) and every interface entry."""
    seen, classes = {}, set()
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] != "transformers" or not isinstance(mod, types.ModuleType):
            continue
        for key, value in list(vars(mod).items()):
            seen[f"{name}.{key}"] = value
            if isinstance(value, type) and value.__module__ == name:
                classes.add(f"{name}.{value.__qualname__}")
                for attr, obj in list(vars(value).items()):
                    seen[f"{name}.{value.__qualname__}.{attr}"] = obj
    for iface in INTERFACES:
        for key, value in iface._global_mapping.items():
            seen[f"{iface.__module__}.{iface.__qualname__}[{key!r}]"] = value
    return seen, classes


def diff(before, after):
    """Labels whose object changed or went away, and new class attributes and interface
    entries (new module attributes come from transformers' lazy imports, not from patches)."""
    (a, classes), (b, _) = before, after
    out = {k for k in a if k not in b or b[k] is not a[k]}
    out |= {k for k in b if k not in a and ("[" in k or k.rpartition(".")[0] in classes)}
    return sorted(out)
'''


def _run(body: str) -> dict:
    code = f"MODELING = {MODELING!r}\n" + SNAPSHOT + body
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_snapshot_sees_each_kind_of_patch():
    """The comparison below can fail: a replaced method, a replaced module function and a new
    interface entry each show up (and only they)."""
    r = _run(r'''
before = snapshot()
mod = sys.modules[MODELING[0]]
GenerationMixin.generate = lambda self: None
mod.causal_conv1d_fn = lambda *a: None
AttentionInterface.register("probe", lambda *a: None)
print(json.dumps({"diff": diff(before, snapshot())}))
''')
    assert r["diff"] == sorted([f"{MODELING[0]}.causal_conv1d_fn",
                                "transformers.generation.utils.GenerationMixin.generate",
                                "transformers.modeling_utils.AttentionInterface['probe']"]), r


def test_import_changes_nothing_register_patches_the_listed_and_disable_restores():
    r = _run(r'''
before = snapshot()
originals = {"generate": GenerationMixin.generate, "post_init": PreTrainedModel.post_init,
             "set_attn_implementation": PreTrainedModel.set_attn_implementation}
import usp_hal.integrations.transformers as usp
import usp_hal.integrations.sequence_mixers, usp_hal.integrations.diffusers, usp_hal.integrations.cache
import usp_hal.integrations.training.trainer, usp_hal.integrations.training.grads
import usp_hal.integrations.training.tiled_loss
from usp_hal.integrations.sequence_mixers import COVERED_LAYERS
res = {"after_import": diff(before, snapshot()),
       "identity_after_import": [GenerationMixin.generate is originals["generate"],
                                 PreTrainedModel.post_init is originals["post_init"],
                                 PreTrainedModel.set_attn_implementation is originals["set_attn_implementation"]],
       "patched_after_import": usp.patched(),
       "covered_modules": sorted({m for m, _ in COVERED_LAYERS.values()}),
       "expected": sorted({f"{m}.{f}" for m, names in COVERED_LAYERS.values() for f in names} | {
           "transformers.generation.utils.GenerationMixin.generate",
           "transformers.modeling_utils.PreTrainedModel.post_init",
           "transformers.modeling_utils.PreTrainedModel.set_attn_implementation",
           "transformers.modeling_utils.AttentionInterface['usp_hal']",
           "transformers.masking_utils.AttentionMaskInterface['usp_hal']"})}
name = usp.register()
res["name"] = name
res["after_register_only"] = diff(before, snapshot())
res["listed_after_register_only"] = usp.patched()
res["listed"] = usp.enable()
registered = snapshot()
res["after_register"] = diff(before, registered)
res["enable_again"] = usp.enable()
res["after_enable_again"] = diff(registered, snapshot())
res["restored"] = usp.disable()
res["after_disable"] = diff(before, snapshot())
res["identity_after_disable"] = [GenerationMixin.generate is originals["generate"],
                                 PreTrainedModel.post_init is originals["post_init"],
                                 PreTrainedModel.set_attn_implementation is originals["set_attn_implementation"]]
res["patched_after_disable"] = usp.patched()
usp.register("usp_hal_again", enable=True)           # enable() after disable() patches again
res["again"] = usp.patched()
usp.disable()
res["after_second_disable"] = diff(before, snapshot())
print(json.dumps(res))
''')
    assert r["after_import"] == [] and r["patched_after_import"] == [], r["after_import"]
    assert all(r["identity_after_import"]), r
    assert r["covered_modules"] == sorted(MODELING), r["covered_modules"]
    assert r["name"] == "usp_hal"
    names = ["transformers.modeling_utils.AttentionInterface['usp_hal']",
             "transformers.masking_utils.AttentionMaskInterface['usp_hal']"]
    assert r["after_register_only"] == sorted(names), r["after_register_only"]     # the name, nothing else
    assert r["listed_after_register_only"] == names, r["listed_after_register_only"]
    assert sorted(r["listed"]) == r["expected"], r["listed"]
    assert r["after_register"] == r["expected"], r["after_register"]     # exactly the listed ones changed
    assert r["enable_again"] == r["listed"] and r["after_enable_again"] == [], r     # idempotent
    assert sorted(r["restored"]) == r["expected"], r["restored"]
    assert r["after_disable"] == [] and all(r["identity_after_disable"]), r["after_disable"]
    assert r["patched_after_disable"] == []
    assert sorted(r["again"]) == sorted(p.replace("'usp_hal'", "'usp_hal_again'") for p in r["expected"]), r["again"]
    assert r["after_second_disable"] == [], r["after_second_disable"]

