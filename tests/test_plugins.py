"""Plugins: built-ins through entry points, fault isolation, strict mode, allow lists, and the
example packages in examples/ (installed by .ci/install-example-plugins.sh; skipped without)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
from kernel_fakes import BUILTIN_DECLARATIONS, builtin_scheme, isolated_plugins

from qscheme.catalog import load_catalog
from qscheme.errors import PluginError
from qscheme.kernels import registry
from qscheme.kernels.declaration import ANY_DEVICE, DeviceSupport, KernelDeclaration, Supports
from qscheme.kernels.problem import Problem
from qscheme.plugins import BUILTIN_PLUGINS, Plugins, hookimpl, load_plugins, register_plugin

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "plugins.md"
BUILTIN_KERNELS = {
    "reference",
    "dequant_gemm",
    "cpu_gemv",
    "cpu_gemv_blocks",
    "cpu_gemv_blocks_bf16",
    "cpu_gemm_blocks",
    "cpu_int8_gemm",
    "triton",
    "marlin",
    "marlin_mxfp4",
    "native_fp4",
    "native_mxfp4",
    "native_fp8",
    "native_fp8_rowwise",
    "native_fp8_block",
    "native_fp8_cpu",
    "tinygemm",
    "tinygemm_cpu",
}
NO_AUTOLOAD = {"QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1"}
EXTRA = KernelDeclaration(
    "extra_kernel",
    "test",
    3,
    (Supports(("int4",)),),
    (DeviceSupport(ANY_DEVICE),),
    "qscheme_plugins.reference_kernel:ReferenceKernel",
)


class RaisingPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        raise RuntimeError("boom in a hook")


class MalformedPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[object]:
        return [EXTRA, "not a declaration"]


class MisspelledPlugin:
    @hookimpl
    def qscheme_kernelz(self) -> list[KernelDeclaration]:
        return [EXTRA]


class DuplicatePlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        from qscheme_plugins.reference import REFERENCE

        return [REFERENCE]


def builtins_only() -> Plugins:
    return load_plugins(environ=NO_AUTOLOAD)


def test_builtin_entry_points_match_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["qscheme"] == BUILTIN_PLUGINS


def test_builtins_load_and_declare_their_kernels() -> None:
    plugins = builtins_only()
    assert {d.name for d in plugins.kernel_declarations()} == BUILTIN_KERNELS
    # tests/kernel_fakes.py's BUILTIN_DECLARATIONS, which the pure resolver tests use, are exactly these
    by_name = {d.name: d for d in plugins.kernel_declarations()}
    assert {d.name: d for d in BUILTIN_DECLARATIONS} == by_name
    assert plugins.failures() == ()
    infos = {i.name: i for i in plugins.infos()}
    assert infos["reference"].builtin and infos["reference"].kernels == ("reference",)
    assert all(d.plugin for d in plugins.kernel_declarations())


@pytest.mark.subprocess
def test_declarations_load_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from qscheme.plugins import load_plugins\n"
        "plugins = load_plugins(environ={'QSCHEME_DISABLE_PLUGIN_AUTOLOAD': '1'})\n"
        f"assert len(plugins.kernel_declarations()) == {len(BUILTIN_KERNELS)}\n"
        "assert 'torch' not in sys.modules, 'declarations imported torch'\n"
        "from qscheme.cli.main import main\n"
        "assert main(['plugins', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, '`qscheme plugins` imported torch'\n"
    )
    environ = {**os.environ, "QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, env=environ)


def test_a_raising_hook_is_recorded_and_others_keep_working() -> None:
    plugins = builtins_only()
    assert plugins.register(RaisingPlugin(), "raiser")
    assert plugins.register(MalformedPlugin(), "malformed")
    names = {d.name for d in plugins.kernel_declarations()}
    assert names == BUILTIN_KERNELS | {"extra_kernel"}
    failures = {f.plugin: f for f in plugins.failures()}
    assert failures["raiser"].stage == "hook qscheme_kernels"
    assert failures["raiser"].error == "RuntimeError: boom in a hook"
    assert failures["malformed"].error == "returned 'not a declaration' (str), not a KernelDeclaration"
    infos = {i.name: i for i in plugins.infos()}
    assert infos["malformed"].kernels == ("extra_kernel",)
    assert infos["raiser"].failures[0].error == "RuntimeError: boom in a hook"


def test_unknown_hooks_and_duplicate_kernels_are_refused() -> None:
    plugins = builtins_only()
    assert not plugins.register(MisspelledPlugin(), "misspelled")
    assert plugins.register(DuplicatePlugin(), "duplicate")
    assert {d.name for d in plugins.kernel_declarations()} == BUILTIN_KERNELS
    errors = {f.plugin: f.error for f in plugins.failures()}
    assert errors["misspelled"] == "unknown hook qscheme_kernelz; known hooks: qscheme_kernels, qscheme_schemes"
    assert errors["duplicate"] == "kernel 'reference' is already declared by plugin 'reference'; rename it"


def test_strict_mode_makes_failures_fatal() -> None:
    plugins = load_plugins(environ={**NO_AUTOLOAD, "QSCHEME_STRICT_PLUGINS": "1"})
    plugins.register(RaisingPlugin(), "raiser")
    with pytest.raises(PluginError, match=r"raiser .* RuntimeError: boom in a hook .*QSCHEME_STRICT_PLUGINS=1"):
        plugins.kernel_declarations()


class GoodPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        return [EXTRA]


class FakeEntryPoint:
    """An entry point of a distribution that is not installed (what loading reads of one)."""

    def __init__(self, name: str, value: str, distribution: str, target: object = None) -> None:
        self.name, self.value, self.group = name, value, "qscheme"
        self.dist = SimpleNamespace(metadata={"Name": distribution}, version="9.9")
        self.target = target

    def load(self) -> object:
        return self.target if self.target is not None else importlib.import_module(self.value)


FAKE_POINTS = [
    FakeEntryPoint("importfail", "qscheme_no_such_module_for_tests", "fake-dist"),
    FakeEntryPoint("good", "tests:GoodPlugin", "other-dist", GoodPlugin()),
]


def test_an_entry_point_that_fails_to_import_is_recorded() -> None:
    plugins = load_plugins(environ={}, entry_points=FAKE_POINTS)
    failure = next(f for f in plugins.failures() if f.plugin == "importfail")
    assert (failure.distribution, failure.version, failure.stage) == ("fake-dist", "9.9", "import")
    assert failure.error == "ModuleNotFoundError: No module named 'qscheme_no_such_module_for_tests'"
    assert str(failure).startswith("importfail (fake-dist 9.9) import: ModuleNotFoundError")
    # The built-ins (loaded directly: no qscheme entry points were given) and the good plugin work.
    assert {d.name for d in plugins.kernel_declarations()} == BUILTIN_KERNELS | {"extra_kernel"}
    assert [f.plugin for f in plugins.failures()] == ["importfail"]


def test_autoload_can_be_disabled_or_limited_to_named_plugins() -> None:
    disabled = load_plugins(environ=NO_AUTOLOAD, entry_points=FAKE_POINTS)
    assert disabled.failures() == ()
    skipped = {i.name: i.skipped for i in disabled.infos() if not i.builtin}
    assert skipped == {"importfail": "QSCHEME_DISABLE_PLUGIN_AUTOLOAD=1", "good": "QSCHEME_DISABLE_PLUGIN_AUTOLOAD=1"}
    only_good = load_plugins(environ={"QSCHEME_PLUGINS": "other-dist"}, entry_points=FAKE_POINTS)
    assert only_good.failures() == ()
    assert "extra_kernel" in {d.name for d in only_good.kernel_declarations()}
    assert {i.name: i.skipped for i in only_good.infos()}["importfail"] == "not named in QSCHEME_PLUGINS"
    none = load_plugins(environ={"QSCHEME_PLUGINS": ""}, entry_points=FAKE_POINTS)
    assert none.failures() == ()


VALID = textwrap.dedent(
    """\
    name: plugin-test/W8A16
    description: int8 weights per channel, 16-bit activations
    weight:
      format: int8
      tensor: {name: weight, dtype: int8, shape: [N, K]}
      scale:
        granularity: channel
        format: fp32
        stored: multiplier
        tensor: {name: weight_scale, dtype: float32, shape: [N, 1]}
    activation: none
    """
)


def test_plugin_schemes_reach_the_catalog_and_bad_ones_are_isolated(tmp_path: Path) -> None:
    folder = tmp_path / "schemes"
    folder.mkdir()
    (folder / "good.yaml").write_text(VALID)
    (folder / "bad.yaml").write_text("name: plugin-test/bad\nweight: 3\n")
    (folder / "clash.yaml").write_text(VALID.replace("plugin-test/W8A16", "compressed-tensors/W4A16"))

    class SchemePlugin:
        @hookimpl
        def qscheme_schemes(self) -> list[Path]:
            return [folder]

    with isolated_plugins() as plugins:
        register_plugin(SchemePlugin(), "scheme-plugin")
        catalog = load_catalog()
        assert catalog.get("plugin-test/W8A16").source == "plugin:scheme-plugin"
        errors = [f.error for f in plugins.failures()]  # type: ignore[attr-defined]
        assert any(e.startswith("invalid descriptor:") and "bad.yaml" in e for e in errors)
        assert any("'compressed-tensors/W4A16'" in e and "already defined" in e for e in errors)
        info = next(i for i in plugins.infos() if i.name == "scheme-plugin")  # type: ignore[attr-defined]
        assert info.schemes == ("plugin-test/W8A16",)


def _scheme_plugin(folder: Path) -> object:
    class SchemePlugin:
        @hookimpl
        def qscheme_schemes(self) -> list[Path]:
            return [folder]

    return SchemePlugin()


def test_a_plugin_scheme_that_clashes_with_the_scheme_path_is_refused_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, shipped = tmp_path / "path", tmp_path / "plugin"
    local.mkdir()
    shipped.mkdir()
    (local / "mine.yaml").write_text(VALID)
    (shipped / "same.yaml").write_text(VALID)
    (shipped / "other.yaml").write_text(VALID.replace("plugin-test/W8A16", "plugin-test/other"))
    monkeypatch.delenv("QSCHEME_SCHEME_PATH", raising=False)
    with isolated_plugins() as plugins:
        register_plugin(_scheme_plugin(shipped), "clashing")
        assert load_catalog().get("plugin-test/W8A16").source == "plugin:clashing"
        assert plugins.failures() == ()  # type: ignore[attr-defined]
        monkeypatch.setenv("QSCHEME_SCHEME_PATH", str(local))  # the folder is added later: still seen
        catalog = load_catalog()
        assert catalog.get("plugin-test/W8A16").source == f"path:{local}"
        assert catalog.get("plugin-test/other").source == "plugin:clashing"
        assert catalog.get("compressed-tensors/NVFP4").source == "builtin"
        assert builtin_scheme("compressed-tensors/W4A16").name == "compressed-tensors/W4A16"
        load_catalog()  # the refusal is recorded once, not on every load
        failures = plugins.failures()  # type: ignore[attr-defined]
        assert [(f.plugin, f.stage) for f in failures] == [("clashing", "hook qscheme_schemes")]
        assert failures[0].error == (
            f"scheme 'plugin-test/W8A16' in {shipped / 'same.yaml'} is already defined by {local / 'mine.yaml'} "
            f"(path:{local}); scheme names must be unique: rename the plugin's scheme or the other one"
        )
        info = next(i for i in plugins.infos() if i.name == "clashing")  # type: ignore[attr-defined]
        assert info.schemes == ("plugin-test/other",)
    with isolated_plugins({**NO_AUTOLOAD, "QSCHEME_STRICT_PLUGINS": "1"}):
        register_plugin(_scheme_plugin(shipped), "clashing")
        strict = r"clashing \(in-process\) hook qscheme_schemes: scheme 'plugin-test/W8A16'"
        with pytest.raises(PluginError, match=strict):
            load_catalog()


def test_a_plugin_kernel_for_nvfp4_weights_with_fp8_inputs_resolves_that_scheme() -> None:
    from qscheme.kernels.declaration import ActivationSupport

    pair = KernelDeclaration(
        "w4a8_test",
        "test",
        1,
        (Supports(("nvfp4",), activations=(ActivationSupport("fp8", "tensor", dynamic=False),)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference_kernel:ReferenceKernel",
    )

    class PairPlugin:
        @hookimpl
        def qscheme_kernels(self) -> list[KernelDeclaration]:
            return [pair]

    scheme = builtin_scheme("modelopt/W4A8_NVFP4_FP8")
    with isolated_plugins():
        before = registry.resolve_layer(scheme, Problem(256, 512), "cpu", environ={})
        assert before.kernel is None
        message = str(registry.no_kernel_error(before))
        assert "No kernel implements nvfp4 weights with fp8 static per tensor activations." in message
        assert "none (16-bit)" in message and "marlin, dequant_gemm, triton, cpu_gemv, reference" in message
        register_plugin(PairPlugin(), "pair-plugin")
        after = registry.resolve_layer(scheme, Problem(256, 512), "cpu", environ={})
        assert after.kernel is not None and after.kernel.name == "w4a8_test"
        assert after.kernel.plugin == "pair-plugin"


def test_an_implementation_that_fails_to_import_is_rejected_not_fatal() -> None:
    broken = KernelDeclaration(
        "broken_code",
        "test",
        99,
        (Supports(("int4",)),),
        (DeviceSupport(ANY_DEVICE),),
        "qscheme_plugins.reference:NoSuchKernel",
    )

    class BrokenCodePlugin:
        @hookimpl
        def qscheme_kernels(self) -> list[KernelDeclaration]:
            return [broken]

    scheme = builtin_scheme("compressed-tensors/W4A16")
    with isolated_plugins():
        register_plugin(BrokenCodePlugin(), "broken-code")
        environ: dict[str, str] = {}
        problem = Problem(256, 512)  # bf16 inputs
        # resolution already imports the kernel it would choose: it never reports broken_code, and
        # goes on to the next kernel by priority whose code loads (cpu_gemv, 62 for int4, on a CPU)
        reported = registry.resolve_layer(scheme, problem, "cpu", environ=environ)
        resolution, declaration, _ = registry.select_kernel(scheme, problem, "cpu", environ=environ)
        assert reported.kernel == declaration and declaration.name == "cpu_gemv"
        rejected = resolution.candidate("broken_code")
        assert rejected.stage == "device"
        assert "failed to load: AttributeError: qscheme_plugins.reference has no attribute 'NoSuchKernel'" in (
            rejected.reason
        )


# --- the example packages, installed with pip (CI: .ci/install-example-plugins.sh) -----------------

EXAMPLE_INSTALLED = importlib.util.find_spec("qscheme_example_plugin") is not None
BROKEN_SITE = ROOT / "build" / "qscheme-broken-plugin-site"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """Run `qscheme` commands in-process with plugins loaded afresh from the real entry points."""
    from qscheme.cli.main import main
    from qscheme.plugins import reset_plugins

    monkeypatch.delenv("QSCHEME_DISABLE_PLUGIN_AUTOLOAD", raising=False)

    def run(argv: list[str], **env: str) -> dict[str, object]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        reset_plugins(None)
        registry.reset()
        code = main(argv)
        captured = capsys.readouterr()
        for name in env:
            monkeypatch.delenv(name)
        return {"code": code, "out": captured.out, "err": captured.err}

    yield run
    reset_plugins(None)
    registry.reset()


@pytest.mark.skipif(
    not EXAMPLE_INSTALLED, reason="qscheme-example-plugin is not installed (.ci/install-example-plugins.sh)"
)
def test_installed_example_plugin_appears_and_wins_with_higher_priority(cli) -> None:  # type: ignore[no-untyped-def]
    env = {"QSCHEME_DISABLED_KERNELS": "triton"}
    listed = cli(["kernels", "--device", "cpu", "--json"], **env)
    kernels = {k["name"]: k for k in json.loads(str(listed["out"]))}
    assert kernels["example_dequant"]["provider"] == "qscheme-example-plugin"
    assert kernels["example_dequant"]["priority"] == -10
    assert kernels["example_dequant"]["available"] is True
    low = cli(["resolve", "compressed-tensors/W4A16", "--device", "cpu", "--json"], **env)
    assert json.loads(str(low["out"]))["kernel"] == "cpu_gemv"  # the built-in CPU int4 kernel (priority 62)
    high = cli(
        ["resolve", "compressed-tensors/W4A16", "--device", "cpu", "--json"], QSCHEME_EXAMPLE_PRIORITY="1000", **env
    )
    assert json.loads(str(high["out"]))["kernel"] == "example_dequant"
    shipped = cli(["resolve", "example/W4A16_G64", "--device", "cpu", "--json"], **env)
    assert shipped["code"] == 0 and json.loads(str(shipped["out"]))["scheme"] == "example/W4A16_G64"
    plugins = cli(["plugins", "--json"])
    example = next(p for p in json.loads(str(plugins["out"])) if p["name"] == "example")
    assert example["distribution"] == "qscheme-example-plugin" and example["version"] == "0.1.0"
    assert example["kernels"] == ["example_dequant"] and example["schemes"] == ["example/W4A16_G64"]

    # The example kernel's code really runs a layer (through QuantLinear, as a loader would).
    import torch

    from qscheme.modules import QuantLinear

    weight = torch.randn(64, 128)
    scale = weight.abs().amax() / 448
    tensors = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    layer = QuantLinear.from_tensors("modelopt/fp8_pb_wo", tensors, kernel="example_dequant")
    assert layer.kernel.name == "example_dequant" and layer.kernel.plugin == "example"
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t())


def _installed_is_current(source: Path) -> bool:
    """Whether build/qscheme-broken-plugin-site holds this checkout's package (not an older one)."""
    installed = BROKEN_SITE / "qscheme_broken_plugin"
    modules = sorted((source / "qscheme_broken_plugin").glob("*.py"))
    return installed.is_dir() and all(
        (installed / m.name).is_file() and (installed / m.name).read_bytes() == m.read_bytes() for m in modules
    )


def _broken_site(tmp_path: Path) -> Path:
    """The pip-installed broken plugin if CI installed it, else the same package laid out by hand."""
    source = ROOT / "examples" / "qscheme-broken-plugin"
    if _installed_is_current(source):
        return BROKEN_SITE
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    shutil.copytree(source / "qscheme_broken_plugin", tmp_path / "qscheme_broken_plugin")
    info = tmp_path / f"qscheme_broken_plugin-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = "".join(f"{name} = {value}\n" for name, value in project["entry-points"]["qscheme"].items())
    (info / "entry_points.txt").write_text(f"[qscheme]\n{points}")
    return tmp_path


def test_broken_plugins_are_reported_and_resolve_keeps_working(
    cli,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.syspath_prepend(str(_broken_site(tmp_path)))
    env = {"QSCHEME_PLUGINS": "qscheme-broken-plugin"}
    plugins = cli(["plugins", "--json"], **env)
    assert plugins["code"] == 1  # the listing is complete, and says some plugins failed
    reported = {p["name"]: p for p in json.loads(str(plugins["out"]))}
    assert reported["broken-import"]["loaded"] is False
    assert reported["broken-import"]["errors"][0]["stage"] == "import"
    assert "qscheme_example_missing_dependency" in reported["broken-import"]["errors"][0]["error"]
    assert reported["broken-import"]["distribution"] == "qscheme-broken-plugin"
    assert reported["broken-hook"]["errors"][0]["error"].startswith("RuntimeError: the broken-hook")
    assert reported["broken-malformed"]["errors"]
    text = str(cli(["plugins"], **env)["out"])
    assert any(line.startswith("broken-import ") and line.endswith(" failed") for line in text.splitlines())
    assert "broken-hook (qscheme-broken-plugin 0.1.0) hook qscheme_kernels: RuntimeError" in text

    resolved = cli(["resolve", "compressed-tensors/W4A16", "--device", "sm90", "--json"], **env)
    assert resolved["code"] == 0
    decision = json.loads(str(resolved["out"]))
    assert decision["kernel"] is not None and decision["plugin_failures"]
    unresolved = cli(["resolve", "modelopt/W4A8_NVFP4_FP8", "--device", "sm90"], **env)
    assert unresolved["code"] == 1
    assert "plugin errors (see `qscheme plugins`):" in str(unresolved["out"])
    assert "broken-import (qscheme-broken-plugin 0.1.0) import: ModuleNotFoundError" in str(unresolved["out"])

    strict = cli(["resolve", "compressed-tensors/W4A16", "--device", "sm90"], QSCHEME_STRICT_PLUGINS="1", **env)
    assert strict["code"] == 1
    assert "QSCHEME_STRICT_PLUGINS=1 makes plugin failures fatal" in str(strict["err"])


BROKEN_KERNELS = {
    "broken_dependency": "failed to load: ModuleNotFoundError: No module named "
    "'qscheme_example_missing_kernel_library'",
    "broken_missing_class": "failed to load: AttributeError: qscheme_broken_plugin.kernels has no attribute "
    "'MissingKernel'",
    "broken_interface": "failed to load: TypeError: qscheme_broken_plugin.kernels:PrepareOnlyKernel does not "
    "implement the kernel interface: no apply method",
}


@pytest.fixture(scope="module")
def broken_cli(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Run `qscheme` in a real subprocess with the broken plugin package on PYTHONPATH (one process a call:
    the import cache is per process)."""
    site = _broken_site(tmp_path_factory.mktemp("broken-site"))
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "QSCHEME_PLUGINS": "qscheme-broken-plugin",
        "TRITON_INTERPRET": "1",
    }
    environ.pop("QSCHEME_DISABLE_PLUGIN_AUTOLOAD", None)

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "qscheme.cli.main", *argv],
            cwd=ROOT,
            env={**environ, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


@pytest.fixture(scope="module")
def tiny_w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qscheme.examples.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "w4a16", layers=1, scheme="compressed-tensors/W4A16")


def _assert_rejected_for_their_code(trace: list[dict[str, object]]) -> None:
    rows = {row["kernel"]: row for row in trace}
    for name, reason in BROKEN_KERNELS.items():
        assert rows[name]["accepted"] is False and rows[name]["chosen"] is False
        assert rows[name]["stage"] == "device" and reason in str(rows[name]["reason"]), rows[name]


@pytest.mark.subprocess
def test_kernels_whose_code_cannot_be_imported_are_not_available(broken_cli) -> None:  # type: ignore[no-untyped-def]
    listed = broken_cli("kernels", "--device", "cpu", "--json")
    assert listed.returncode == 0, listed.stderr
    records = {r["name"]: r for r in json.loads(listed.stdout)}
    for name, reason in BROKEN_KERNELS.items():
        assert records[name]["available"] is False and reason in records[name]["reason"]
        assert records[name]["plugin"] == "broken-code"
    assert records["reference"]["available"] is True and records["triton"]["available"] is True
    text = broken_cli("kernels", "--device", "cpu")
    rows: dict[str, str] = {}
    for line in text.stdout.splitlines():  # the table's row comes before the kernel's details
        if line.startswith(("broken_", "reference ")):
            rows.setdefault(line.split()[0], line)
    for name, reason in BROKEN_KERNELS.items():
        assert re.search(rf"^{name} +qscheme-broken-plugin +\d+ +broken-code +no +implementation ", rows[name])
        assert reason in rows[name]
    assert re.search(r" yes +- *$", rows["reference"])


@pytest.mark.subprocess
def test_resolve_rejects_kernels_whose_code_cannot_be_imported(broken_cli) -> None:  # type: ignore[no-untyped-def]
    resolved = broken_cli("resolve", "compressed-tensors/W4A16", "--device", "cpu", "--json")
    assert resolved.returncode == 0, resolved.stderr
    decision = json.loads(resolved.stdout)
    # the three broken kernels rank higher, and are all rejected; cpu_gemv (62 for int4) outranks
    # tinygemm_cpu (60) and triton (50)
    assert decision["kernel"] == "cpu_gemv"
    _assert_rejected_for_their_code(decision["trace"])
    text = broken_cli("resolve", "compressed-tensors/W4A16", "--device", "cpu").stdout
    assert text.startswith("kernel: cpu_gemv for scheme compressed-tensors/W4A16")
    for name, reason in BROKEN_KERNELS.items():
        assert re.search(
            rf"\n{name} +qscheme-broken-plugin +\d+ +rejected +device +implementation .*{re.escape(reason)}", text
        )
    # forced, a kernel whose code fails leaves the layer without a kernel, and the hint offers only working ones
    forced = broken_cli("resolve", "compressed-tensors/W4A16", "--device", "cpu", "--kernel", "broken_interface")
    assert forced.returncode == 1
    assert "kernel: none: forced kernel 'broken_interface' cannot run" in forced.stdout
    assert BROKEN_KERNELS["broken_interface"] in forced.stdout
    assert "hint: kernel cpu_gemv can run this layer here" in forced.stdout


@pytest.mark.subprocess
def test_resolve_and_run_a_checkpoint_without_the_broken_kernels(broken_cli, tiny_w4a16: Path) -> None:  # type: ignore[no-untyped-def]
    resolved = broken_cli("resolve", str(tiny_w4a16), "--device", "cpu", "--json")
    assert resolved.returncode == 0, resolved.stderr
    decisions = json.loads(resolved.stdout)
    assert {layer["kernel"] for layer in decisions["layers"]} == {"cpu_gemv"}
    unavailable = {u["kernel"]: u for u in decisions["unavailable_kernels"]}
    assert set(unavailable) == set(BROKEN_KERNELS)
    for name, reason in BROKEN_KERNELS.items():
        assert (
            unavailable[name]["plugin"] == "broken-code"
            and reason.removeprefix("failed to load: ") in (unavailable[name]["reason"])
        )
    text = broken_cli("resolve", str(tiny_w4a16), "--device", "cpu").stdout
    assert "7 of 7 layers have a kernel\n\nkernels rejected: their code failed to import" in text
    assert "  broken_dependency (plugin broken-code): ModuleNotFoundError: No module named" in text

    ran = broken_cli("run", str(tiny_w4a16), "--rows", "2", "--json")  # bf16 inputs: cpu_gemv runs them
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["failed"] == 0 and {layer["kernel"] for layer in result["layers"]} == {"cpu_gemv"}
    assert {u["kernel"] for u in result["unavailable_kernels"]} == set(BROKEN_KERNELS)
    text = broken_cli("run", str(tiny_w4a16), "--rows", "2").stdout
    assert "kernels rejected: their code failed to import (`qscheme kernels` lists them):" in text
    for name, reason in BROKEN_KERNELS.items():
        assert f"  {name} (plugin broken-code): {reason.removeprefix('failed to load: ')}" in text
    forced = broken_cli("run", str(tiny_w4a16), "--rows", "2", "--kernel", "broken_dependency")
    assert forced.returncode == 1 and "Traceback" not in forced.stderr
    assert "forced kernel 'broken_dependency' cannot run layer" in forced.stderr
    assert BROKEN_KERNELS["broken_dependency"] in forced.stderr


# --- docs/plugins.md stays true --------------------------------------------------------------------


def test_the_documented_plugin_module_registers_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    sample = next(block for block in blocks if "def qscheme_kernels" in block)
    (tmp_path / "doc_sample_plugin.py").write_text(sample)
    example = ROOT / "examples" / "qscheme-example-plugin" / "qscheme_example_plugin"
    shutil.copytree(example / "schemes", tmp_path / "schemes")
    spec = importlib.util.spec_from_file_location("doc_sample_plugin", tmp_path / "doc_sample_plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with isolated_plugins() as plugins:
        assert register_plugin(module, "doc-sample")
        declared = {d.name: d for d in plugins.kernel_declarations()}  # type: ignore[attr-defined]
        assert declared["example_dequant"].plugin == "doc-sample"
        assert load_catalog().get("example/W4A16_G64").source == "plugin:doc-sample"
        assert plugins.failures() == ()  # type: ignore[attr-defined]


def test_the_docs_say_every_builtin_kernel_has_its_code() -> None:
    """No built-in kernel is a declaration only any more (``marlin`` got its code last): the docs
    must not call one so, and must still say what a declared-only (third-party) kernel gets."""
    declarations = builtins_only().kernel_declarations()
    assert {d.name for d in declarations} == BUILTIN_KERNELS
    assert [d.name for d in declarations if d.implementation is None] == []
    introduction = " ".join(DOCS.read_text().split("## The contract")[0].split())
    for phrase in ("is a declaration only", "are declarations only", "declaration-only"):
        assert phrase not in introduction
    for name in BUILTIN_KERNELS:
        assert f"`{name}`" in introduction
    assert "Every built-in has its code" in introduction
    assert "declared only: no implementation is installed" in introduction  # the resolver's reason


def test_every_declaration_field_is_documented() -> None:
    section = DOCS.read_text().split("## The declaration")[1].split("## The implementation")[0]
    missing = [f.name for f in dataclasses.fields(KernelDeclaration) if f"`{f.name}`" not in section]
    assert missing == []


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"QSCHEME_DISABLED_KERNELS": "refrence"}, "names undeclared kernel(s) 'refrence' (did you mean 'reference'?)"),
        ({"QSCHEME_DISABLED_KERNELS": "triton;reference"}, "names undeclared kernel(s) 'triton;reference'"),
        ({"QSCHEME_KERNEL": "refrence"}, "QSCHEME_KERNEL='refrence' names no declared kernel; did you mean"),
    ],
)
def test_kernel_names_from_the_environment_must_be_declared(variables: dict[str, str], message: str) -> None:
    from qscheme.errors import UsageError
    from qscheme.kernels.devices import simulated_device

    with isolated_plugins():
        with pytest.raises(UsageError, match=re.escape(message)):
            registry.resolver(simulated_device("sm90"), environ=variables)
        # an explicit kernel argument is checked where it is used, with its own message
        assert registry.resolver(simulated_device("sm90"), "reference", environ={}).force == "reference"


class ExitingPlugin:
    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        sys.exit(7)


def test_a_hook_that_exits_is_recorded_not_fatal() -> None:
    plugins = builtins_only()
    assert plugins.register(ExitingPlugin(), "exiter")
    assert {d.name for d in plugins.kernel_declarations()} == BUILTIN_KERNELS
    failures = {f.plugin: f for f in plugins.failures()}
    assert failures["exiter"].stage == "hook qscheme_kernels"
    assert "SystemExit" in failures["exiter"].error


@pytest.mark.parametrize("variable", ["QSCHEME_STRICT_PLUGINS", "QSCHEME_DISABLE_PLUGIN_AUTOLOAD"])
@pytest.mark.parametrize("value", ["2", "enable", "ture", "1 1", "y"])
def test_plugin_switches_refuse_values_that_are_neither_on_nor_off(variable: str, value: str) -> None:
    from qscheme.errors import UsageError

    with pytest.raises(UsageError) as caught:
        load_plugins(environ={variable: value}, entry_points=FAKE_POINTS)
    message = str(caught.value)
    assert f"environment variable {variable}={value!r} is not understood" in message
    assert "allowed: 1, true, yes, on (on) or 0, false, no, off, empty or unset (off)" in message


@pytest.mark.parametrize(("value", "autoload"), [("0", True), ("false", True), (" Off ", True), ("", True)])
def test_plugin_switches_take_explicit_off_values(value: str, autoload: bool) -> None:
    plugins = load_plugins(environ={"QSCHEME_DISABLE_PLUGIN_AUTOLOAD": value}, entry_points=FAKE_POINTS)
    skipped = {i.name: i.skipped for i in plugins.infos() if not i.builtin}
    assert (not skipped["good"]) == autoload
    strict_off = load_plugins(environ={"QSCHEME_STRICT_PLUGINS": value}, entry_points=FAKE_POINTS)
    assert [f.plugin for f in strict_off.failures()] == ["importfail"]  # recorded, not raised


@pytest.mark.parametrize("value", ["ON", "Yes", " true "])
def test_plugin_switches_take_every_on_spelling(value: str) -> None:
    plugins = load_plugins(environ={"QSCHEME_DISABLE_PLUGIN_AUTOLOAD": value}, entry_points=FAKE_POINTS)
    assert {i.name: i.skipped for i in plugins.infos() if not i.builtin}["good"] == "QSCHEME_DISABLE_PLUGIN_AUTOLOAD=1"
    with pytest.raises(PluginError, match="QSCHEME_STRICT_PLUGINS=1 makes plugin failures fatal"):
        load_plugins(environ={"QSCHEME_STRICT_PLUGINS": value}, entry_points=FAKE_POINTS)


@pytest.mark.parametrize("value", ["good;rm -rf", "good, other dist", "$(id)", "good,/tmp/x"])
def test_plugin_allow_list_refuses_entries_that_are_not_names(value: str) -> None:
    from qscheme.errors import UsageError

    with pytest.raises(
        UsageError, match=r"environment variable QSCHEME_PLUGINS=.*is not a plugin name; allowed: comma"
    ):
        load_plugins(environ={"QSCHEME_PLUGINS": value}, entry_points=FAKE_POINTS)
    spaced = load_plugins(environ={"QSCHEME_PLUGINS": " other-dist , ,"}, entry_points=FAKE_POINTS)
    assert "extra_kernel" in {d.name for d in spaced.kernel_declarations()}


def test_a_bad_plugin_variable_is_a_usage_error_of_the_command(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli(["resolve", "compressed-tensors/W4A16", "--device", "sm90"], QSCHEME_STRICT_PLUGINS="maybe")
    assert result["code"] == 2
    assert "environment variable QSCHEME_STRICT_PLUGINS='maybe' is not understood" in str(result["err"])
    assert "Traceback" not in str(result["err"])
