"""GPU presets, a user's own device from a file, and the checks on both."""

from __future__ import annotations

import pytest

from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.core.hardware import DEFAULT_GPU, PRESETS, hardware_from_dict, load_hardware, preset
from memshard.core.mesh import parse_mesh


def test_every_issue_preset_is_there_and_valid():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"):
        h = preset(name)
        assert h.name == name and h.check() is h
        assert 0 < h.matmul_efficiency <= 1 and h.peak_flops > h.peak_flops_fp32
    assert DEFAULT_GPU == "h100-sxm"
    # newer parts are faster where the spec sheets say so
    assert PRESETS["h100-sxm"].peak_flops > PRESETS["a100-80gb"].peak_flops
    assert PRESETS["h200"].memory_bandwidth > PRESETS["h100-sxm"].memory_bandwidth
    assert PRESETS["b200"].peak_flops_fp8 == 2 * PRESETS["b200"].peak_flops


def test_the_mesh_takes_the_devices_figures_and_overrides():
    mesh = parse_mesh("2x8", hardware="a100-40gb")
    assert mesh.device_memory_bytes == 40 * 2**30 and mesh.peak_flops == 312e12
    mesh = parse_mesh("2x8", hardware="a100-40gb", peak_flops=100e12, compute_efficiency=0.5, device_memory_bytes=2**30)
    assert (mesh.peak_flops, mesh.compute_efficiency, mesh.device_memory_bytes) == (100e12, 0.5, 2**30)


def test_a_file_replaces_its_base_presets_fields(tmp_path):
    toml = tmp_path / "mine.toml"
    toml.write_text('base = "a100-80gb"\nname = "mine"\ngpus_per_node = 4\n')
    h = load_hardware(str(toml))
    assert (h.name, h.gpus_per_node, h.peak_flops) == ("mine", 4, 312e12)
    js = tmp_path / "mine.json"
    js.write_text('{"name": "j", "memory_bandwidth": 1e12}')
    assert load_hardware(str(js)).memory_bandwidth == 1e12  # on the default GPU


@pytest.mark.parametrize("data", [{"base": "nope"}, {"flops": 1}, {"matmul_efficiency": 1.5},
                                  {"memory_bandwidth": -1}, {"gpus_per_node": 2.5}, {"peak_flops": "fast"}])
def test_bad_hardware_fields_are_refused(data):
    with pytest.raises(MemshardError):
        hardware_from_dict(data)


def test_the_cli_refuses_bad_hardware_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("base = \n")
    for args in (["--hardware", str(bad)], ["--hardware", str(tmp_path / "missing.json")],
                 ["--gpu", "h100-sxm", "--hardware", str(bad)]):
        assert main(["plan", "--model", "tiny-gpt", "--mesh", "2", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("memshard: error: ") and "\n" not in err
