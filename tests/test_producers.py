"""qscheme.producers: one folder per producer, one registry, below the loader and the writer."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from import_walk import ROOT, chains, closure

from qscheme.catalog import load_catalog
from qscheme.checkpoint.config import CONFIG_FILES
from qscheme.descriptor import parse_scheme_text, rules
from qscheme.descriptor.summary import render_scheme, scheme_dict
from qscheme.errors import SchemeError
from qscheme.folder_catalog import builtin_scheme_dir
from qscheme.producers import PRODUCERS, producer_of_config
from qscheme.producers.compressed_tensors import CompressedTensorsConfig
from qscheme.writing.producer_config import producer_of

PRODUCERS_FOLDER = ROOT / "producers"
# What a producer must never import, directly or through another module, at module level or
# inside a function: the loader, the writer and what is built on them. checkpoint.patterns (the
# ``re:`` checks every config reader uses) sits below them.
ABOVE = ("qscheme.checkpoint", "qscheme.parallel", "qscheme.writing", "qscheme.transformers", "qscheme.quantize.weight")
BELOW_ABOVE = ("qscheme.checkpoint.patterns",)


def _producer_modules() -> list[str]:
    return [
        ".".join(("qscheme", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for path in sorted(PRODUCERS_FOLDER.rglob("*.py"))
    ]


def test_producers_import_nothing_of_the_loader_or_the_writer() -> None:
    start = _producer_modules()
    assert "qscheme.producers.compressed_tensors.arithmetic" in start
    # The root package runs before any of its modules anyway (its __version__ is read).
    reached = closure(start, skip=("qscheme",))
    above = sorted(name for name in reached if name.startswith(ABOVE) and name not in BELOW_ABOVE)
    assert not above, "a producer reaches the loader or the writer:\n" + chains(reached, above)


def test_the_registry_names_each_producer_and_method_once() -> None:
    names = [p.name for p in PRODUCERS]  # issue 27's producers sit between modelopt and self-described
    assert names[:2] == ["compressed-tensors", "modelopt"] and names[-1] == "qscheme" and "mxfp4" in names
    assert len({p.quant_method for p in PRODUCERS}) == len(PRODUCERS)
    assert CONFIG_FILES == ("config.json", "hf_quant_config.json")
    config = CompressedTensorsConfig("config.json", (), (), None, None, None, None)
    assert producer_of_config(config).name == "compressed-tensors"


def test_every_built_in_scheme_is_written_by_the_producer_whose_rule_detects_it() -> None:
    """...where that producer writes checkpoints; a read-only producer's schemes (gpt-oss MXFP4) are
    written as qscheme's self-describing checkpoints."""
    read_only = [p.name for p in PRODUCERS if not any(p.writes(s) for s in load_catalog())]
    assert "mxfp4" in read_only and "compressed-tensors" not in read_only
    for scheme in load_catalog():
        expected = next(
            (
                p.name
                for p in PRODUCERS
                if p.rule_schema is not None and scheme.detect.get(p.rule_schema.producer) and p.writes(scheme)
            ),
            "qscheme",
        )
        assert producer_of(scheme) == expected, scheme.name


@pytest.mark.subprocess
def test_the_registry_and_config_reading_do_not_import_torch() -> None:
    """Each producer's arithmetic is named, not imported: reading configs stays torch-free."""
    code = (
        "import sys, qscheme.producers, qscheme.checkpoint.config, qscheme.writing.producer_config; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_the_detect_rules_descriptors_accept_are_the_producers_own() -> None:
    # GGUF files describe themselves: its rule is registered without a config-reading Producer
    assert rules.rule_producers() == (*(p.name for p in PRODUCERS if p.rule_schema is not None), "gguf")
    named = rules.rule_producers()  # issue 27's producers sit between modelopt and gguf
    assert named[:2] == ("compressed-tensors", "modelopt") and named[-1] == "gguf" and "mxfp4" in named


def test_the_descriptor_package_names_no_producer() -> None:
    """No name in descriptor/ (function, class, variable, attribute) is a producer's: a new
    producer declares its detect rule in its own folder (``rule.py``)."""
    found = []
    for path in sorted((ROOT / "descriptor").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name = getattr(node, "name", None) or getattr(node, "id", None) or getattr(node, "attr", None)
            if isinstance(name, str) and any(p in name.lower() for p in ("modelopt", "compressed")):
                found.append(f"{path.name}:{node.lineno}: {name}")  # type: ignore[attr-defined]
    assert not found, found


def _toy_schema() -> rules.RuleSchema:
    return rules.RuleSchema(
        producer="toy",
        keys=(rules.RuleKey("method", "strings", required=True), rules.RuleKey("bits", "integer")),
        build=lambda values: ("toy-rule", values["method"], values["bits"]),
        summary=lambda rule: {"method": list(rule[1]), "bits": rule[2]},
        render=lambda rule: f"toy method {'|'.join(rule[1])}",
    )


def _toy_text(rule: str) -> str:
    text = (builtin_scheme_dir() / "compressed-tensors" / "W4A16.yaml").read_text()
    head = text[: text.index("\ndetect:")]
    head = head.replace("producer: compressed-tensors", "producer: toy")
    head = head.replace("name: compressed-tensors/", "name: toy/")
    return f"{head}\ndetect:\n  toy:\n{rule}"


def test_a_new_producer_rule_needs_no_edit_in_the_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer registered with a rule schema (as ``qscheme.producers`` registers its own) is
    accepted in ``producer:`` and ``detect.<name>``, parsed into its rule, shown, and its bad
    rules are located like any other key."""
    monkeypatch.setitem(rules._SCHEMAS, "toy", _toy_schema())
    scheme = parse_scheme_text(_toy_text("    method: [w4]\n    bits: 4\n"), "toy.yaml")
    assert scheme.producer == "toy" and scheme.rules == "toy"
    assert scheme.detect.get("toy") == ("toy-rule", ("w4",), 4)
    assert scheme_dict(scheme)["detect"] == {"toy": {"method": ["w4"], "bits": 4}}
    assert render_scheme(scheme).endswith("detect:      toy method w4")
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(_toy_text("    bits: 0\n    extra: 1\n"), "toy.yaml")
    message = str(info.value)
    assert "detect.toy: missing required key 'method'" in message
    assert "detect.toy.bits: 0 is not an integer >= 1" in message
    assert "detect.toy.extra: unknown key 'extra'; allowed keys are 'method', 'bits'" in message
    assert "toy.yaml:" in message


def test_an_unregistered_producer_is_refused_in_detect_and_producer() -> None:
    with pytest.raises(SchemeError) as info:
        parse_scheme_text(_toy_text("    method: [w4]\n"), "toy.yaml")
    message = str(info.value)
    assert "producer: 'toy' is not one of 'compressed-tensors', 'modelopt'" in message
    assert "detect.toy: unknown key 'toy'" in message
