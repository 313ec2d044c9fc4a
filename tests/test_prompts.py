"""The Process Management prompt block and the modes that get the ``subprocess`` tool."""

from __future__ import annotations

from importlib import resources

import pytest

from engine import TOOL_MODES, process_management_block, render_mode_prompt, tools_for_mode

TEMPLATE = "You are in {mode} mode.\n\n{{process_management_block}}\n\nKeep {{other_variable}} as is."


def test_process_management_block_ships_as_package_resource() -> None:
    resource = resources.files("engine").joinpath("prompts/process-management-block.md")
    assert resource.is_file()
    block = process_management_block()
    assert block.startswith("## Process Management")
    for cmd in ('"create"', '"list"', '"log"', '"halt"', '"kill"', '"killAll"'):
        assert cmd in block
    assert "subprocess" in block and "{{" not in block


@pytest.mark.parametrize("mode", ["Build", "Test", "Ship", "Develop", "build", " develop "])
def test_render_mode_prompt_inserts_block_in_tool_modes(mode: str) -> None:
    rendered = render_mode_prompt(mode, TEMPLATE)
    assert process_management_block() in rendered
    assert "{{process_management_block}}" not in rendered
    assert "{{other_variable}}" in rendered
    assert tools_for_mode(mode) == ("subprocess",)


@pytest.mark.parametrize("mode", ["Ask", "Plan", "Review", ""])
def test_render_mode_prompt_leaves_block_out_elsewhere(mode: str) -> None:
    rendered = render_mode_prompt(mode, TEMPLATE)
    assert "Process Management" not in rendered and "{{process_management_block}}" not in rendered
    assert tools_for_mode(mode) == ()


def test_tool_modes_are_the_four_of_the_spec() -> None:
    assert frozenset({"Build", "Test", "Ship", "Develop"}) == TOOL_MODES


def test_render_mode_prompt_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        render_mode_prompt("Build", None)  # type: ignore[arg-type]  # deliberately wrong
    with pytest.raises(TypeError):
        tools_for_mode(3)  # type: ignore[arg-type]  # deliberately wrong


def test_the_block_describes_the_extensions_unless_they_are_off() -> None:
    spec = process_management_block(extensions=False)
    extended = process_management_block()
    assert extended.startswith(spec + "\n\n")
    for word in ('"ready"', '"restart"', '"new"', '"grep"', '"input"', '"wait"', '"notify_on_exit"'):
        assert word in extended and word not in spec
    assert spec in render_mode_prompt("Build", TEMPLATE, extensions=False)
    assert '"grep"' not in render_mode_prompt("Build", TEMPLATE, extensions=False)
