"""Megatron-Core 0.19's graph flags (``--cuda-graph-impl transformer_engine|local|full_iteration``,
``--cuda-graph-modules``) map onto graph_fsdp's ``--cuda-graph-impl``/``--cuda-graph-scope``
for every command; contradictions are refused in one line naming both flags."""

from __future__ import annotations

import pytest

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import apply_megatron_graph_spellings
from graph_fsdp.cli.main import build_parser, main


def _mapped(*flags: str, command: str = "train") -> tuple[str, list[str] | None]:
    args = build_parser().parse_args([command, *flags])
    apply_megatron_graph_spellings(args)
    return args.cuda_graph_impl, args.cuda_graph_scope


@pytest.mark.parametrize("command", ["train", "compare", "bench", "profile"])
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--cuda-graph-impl", "transformer_engine"], ("te", None)),
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router"],
            ("torch", ["attn", "moe_router"]),
        ),  # fmt: skip
        (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules"], ("te", [])),
        (["--cuda-graph-impl", "te", "--cuda-graph-modules", "full"], ("te", [])),
        (["--cuda-graph-impl", "full_iteration"], ("torch", ["full_iteration"])),
        (["--cuda-graph-impl", "torch", "--cuda-graph-scope", "attn"], ("torch", ["attn"])),
    ],
)
def test_megatron_spellings_map_onto_ours(command, flags, expected):
    assert _mapped(*flags, command=command) == expected


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            [
                "--cuda-graph-impl",
                "te",
                "--cuda-graph-modules",
                "attn",
                "--cuda-graph-scope",
                "mlp",
            ],
            ["--cuda-graph-modules attn", "--cuda-graph-scope mlp", "give one"],
        ),  # fmt: skip
        (
            ["--cuda-graph-impl", "full_iteration", "--cuda-graph-modules", "attn"],
            ["--cuda-graph-impl full_iteration", "--cuda-graph-modules attn"],
        ),  # fmt: skip
        (
            ["--cuda-graph-impl", "full_iteration", "--cuda-graph-scope", "attn"],
            ["--cuda-graph-scope attn", "te|torch"],
        ),  # fmt: skip
        (
            ["--cuda-graph-impl", "torch", "--cuda-graph-modules", "full_iteration"],
            ["--cuda-graph-impl full_iteration"],
        ),  # fmt: skip
    ],
)
def test_contradictions_name_both_flags(flags, words):
    with pytest.raises(CLIError) as err:
        _mapped(*flags)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_the_command_line_refuses_a_contradiction_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--cuda-graph-impl", "full_iteration", "--cuda-graph-modules", "mlp"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graph-fsdp train: error: --cuda-graph-impl")


def test_an_unknown_module_is_refused_naming_the_flag_used(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--cuda-graph-impl", "local", "--cuda-graph-modules", "attention"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--cuda-graph-modules attention" in err and "attn" in err, err


def test_modules_of_ones_own_scopes_are_accepted():
    """A scope defined with --cuda-graph-scope-modules is a module name too."""
    flags = ["--cuda-graph-impl", "te", "--cuda-graph-scope-modules", "norms=self_attention.norm"]
    assert _mapped(*flags, "--cuda-graph-modules", "norms") == ("te", ["norms"])
