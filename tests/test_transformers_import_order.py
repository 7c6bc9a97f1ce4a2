"""qscheme's transformers quantizers are registered whichever of qscheme and transformers is imported
first, without ``import qscheme`` importing transformers (qscheme/_transformers_hook.py).

Each case runs in a fresh interpreter (``sys.executable``), since what matters is the order of the
first imports of a process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from checkpoint_cache import modelopt_fixture
from safetensors import safe_open

pytestmark = pytest.mark.subprocess

FIXTURE = modelopt_fixture("nvfp4")

LOAD = """
from transformers import AutoModelForCausalLM
from qscheme.modules import QuantLinear
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
layers = sorted(name for name, module in model.named_modules() if isinstance(module, QuantLinear))
registry = sys.modules["transformers.quantizers.auto"]
print(json.dumps({"layers": layers, "loader": type(registry.__loader__).__name__}))
"""


def run(code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a fresh Python; its last stdout line is JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def quantized_modules(folder: Path) -> list[str]:
    """The modules whose weights the fixture stores quantized (they carry a ``weight_scale``)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as reader:
        return sorted(key[: -len(".weight_scale")] for key in reader.keys() if key.endswith(".weight_scale"))


@pytest.mark.parametrize(
    "first_imports",
    [
        "import qscheme\nimport transformers",  # the order the hook exists for
        "import transformers\nimport qscheme",
        "from transformers import AutoModelForCausalLM\nimport qscheme",
    ],
    ids=["qscheme_first", "transformers_first", "auto_class_first"],
)
def test_from_pretrained_routes_modelopt_to_qscheme_in_either_order(first_imports: str) -> None:
    result = run(f"import json, sys\n{first_imports}\n{LOAD}", str(FIXTURE))
    expected = quantized_modules(FIXTURE)
    assert expected, "the fixture has no quantized layer"
    assert result["layers"] == expected
    assert result["loader"] == "SourceFileLoader"  # transformers' module keeps its own loader


def test_qscheme_alone_does_not_import_transformers_and_installs_one_hook() -> None:
    result = run(
        """
        import importlib, json, sys, time
        start = time.perf_counter()
        import qscheme
        seconds = time.perf_counter() - start
        from qscheme import _transformers_hook as hook
        importlib.reload(qscheme)
        hook.install()
        hook.install()
        finders = [f for f in sys.meta_path if getattr(f, "_qscheme_registers_quantizers", False)]
        heavy = sorted(m for m in ("transformers", "torch", "qscheme.transformers") if m in sys.modules)
        print(json.dumps({"finders": len(finders), "heavy": heavy, "seconds": seconds}))
        """
    )
    assert result["heavy"] == []
    assert result["finders"] == 1
    assert isinstance(result["seconds"], float) and result["seconds"] < 5.0  # transformers alone takes seconds


def test_registry_already_loaded_registers_at_import() -> None:
    result = run(
        """
        import json, sys
        import transformers.quantizers.auto as auto
        import qscheme
        hooked = any(getattr(f, "_qscheme_registers_quantizers", False) for f in sys.meta_path)
        owner = auto.AUTO_QUANTIZER_MAPPING.get("modelopt")
        print(json.dumps({"hooked": hooked, "owner": f"{owner.__module__}.{owner.__name__}" if owner else None}))
        """
    )
    assert result == {"hooked": False, "owner": "qscheme.transformers._quantizer.ModeloptHfQuantizer"}


def test_hook_registers_when_the_registry_loads_and_removes_itself() -> None:
    result = run(
        """
        import json, sys
        import qscheme
        import transformers.quantizers.auto as auto
        hooked = any(getattr(f, "_qscheme_registers_quantizers", False) for f in sys.meta_path)
        from qscheme.transformers import registered
        print(json.dumps({"hooked": hooked, "registered": registered(),
                          "mapped": auto.AUTO_QUANTIZER_MAPPING.get("qscheme").__module__}))
        """
    )
    assert result["hooked"] is False
    assert result["mapped"] == "qscheme.transformers._quantizer"
    registered = result["registered"]
    assert isinstance(registered, dict)
    assert registered.get("modelopt") == "qscheme" and registered.get("qscheme") == "qscheme"


def test_failed_registration_warns_with_the_reason_and_transformers_still_imports() -> None:
    result = run(
        """
        import json, sys, warnings
        import qscheme
        sys.modules["qscheme.transformers._config"] = None  # makes the integration's import fail
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import transformers.quantizers.auto as auto
        messages = [f"{w.category.__name__}: {w.message}" for w in caught if "qscheme" in str(w.message)]
        print(json.dumps({"messages": messages, "modelopt": "modelopt" in auto.AUTO_QUANTIZER_MAPPING}))
        """
    )
    messages = result["messages"]
    assert isinstance(messages, list) and len(messages) == 1
    assert messages[0].startswith("TransformersRegistrationWarning: qscheme could not register")
    assert "ModuleNotFoundError" in messages[0] and "qscheme.transformers._config" in messages[0]
    assert result["modelopt"] is False


def test_qscheme_works_without_transformers() -> None:
    result = run(
        """
        import json, sys
        sys.modules["transformers"] = None  # as if transformers were not installed
        import qscheme
        from qscheme.catalog import load_catalog
        names = len(load_catalog().schemes)
        try:
            import transformers
        except ImportError:
            missing = True
        else:
            missing = False
        print(json.dumps({"schemes": names, "missing": missing}))
        """
    )
    assert result["missing"] is True and isinstance(result["schemes"], int) and result["schemes"] > 0


def test_importing_the_integration_first_registers_once_without_warning() -> None:
    # qscheme.transformers imports transformers' registry while it is itself being imported: the hook
    # must leave the registration to the integration's own last line, not call a half-built module.
    result = run(
        """
        import json, sys, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import qscheme.transformers
        import transformers.quantizers.auto as auto
        told = [str(w.message) for w in caught if w.category.__name__ == "TransformersRegistrationWarning"]
        print(json.dumps({"told": told, "registered": qscheme.transformers.registered(),
                          "mapped": auto.AUTO_QUANTIZER_MAPPING.get("modelopt").__module__}))
        """
    )
    assert result["told"] == []
    assert result["mapped"] == "qscheme.transformers._quantizer"
    registered = result["registered"]
    assert isinstance(registered, dict) and registered.get("modelopt") == "qscheme"
