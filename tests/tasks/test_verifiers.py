"""Verifiers: math-verify on hand-written pairs, exact/regex/choice, rewards and plugins (torch-free)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asymptote.tasks.verifiers import (
    ENTRY_POINT_GROUP,
    ChoiceSettings,
    ExactSettings,
    MathSettings,
    PluginSettings,
    Reason,
    RegexSettings,
    Verdict,
    make_verifier,
    plugin_names,
    reward,
    strip_think,
)

# (completion, reference, expected reason): equivalent forms, wrong answers,
# a missing box, text after the box, and the reasoning section.
MATH_PAIRS: list[tuple[str, str, Reason]] = [
    # Equivalent forms of the same value.
    ("The answer is \\boxed{42}.", "42", "correct"),
    ("\\boxed{42.0}", "42", "correct"),
    ("\\boxed{\\frac{1}{2}}", "0.5", "correct"),
    ("\\boxed{\\frac12}", "1/2", "correct"),
    ("\\boxed{0.5}", "\\frac{1}{2}", "correct"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", "correct"),
    ("\\boxed{\\tfrac{2}{4}}", "\\frac{1}{2}", "correct"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt 2", "correct"),
    ("\\boxed{2^{10}}", "1024", "correct"),
    ("\\boxed{1,234}", "1234", "correct"),
    ("\\boxed{1234}", "1,234", "correct"),
    ("\\boxed{\\$18}", "18", "correct"),
    ("\\boxed{10\\%}", "10", "correct"),
    ("\\boxed{x+1}", "1+x", "correct"),
    ("\\boxed{2x+2}", "2(x+1)", "correct"),
    ("\\boxed{x^2-1}", "(x-1)(x+1)", "correct"),
    ("\\boxed{\\pi}", "\\pi", "correct"),
    ("\\boxed{2\\pi}", "\\pi \\cdot 2", "correct"),
    ("\\boxed{(1,2]}", "(1,2]", "correct"),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", "correct"),
    ("\\boxed{-7}", "-7", "correct"),
    ("\\boxed{ -7 }", "-7", "correct"),
    ("\\boxed{\\frac{-1}{3}}", "-\\frac{1}{3}", "correct"),
    ("\\boxed{3\\sqrt{3}}", "\\sqrt{27}", "correct"),
    ("\\boxed{1.50}", "3/2", "correct"),
    ("\\boxed{\\left(\\frac{1}{2}\\right)}", "0.5", "correct"),
    ("\\boxed{x=5}", "5", "correct"),
    ("\\boxed{0.333333}", "\\frac{1}{3}", "correct"),
    ("So we get $\\boxed{12}$ apples.", "12", "correct"),
    # Text after the box, several boxes, and the reasoning section.
    ("\\boxed{7}. I double-checked it with another method.", "7", "correct"),
    # Several boxes are read together, so boxing every candidate never pays.
    ("First \\boxed{3}, wait, no: \\boxed{4}", "4", "wrong"),
    ("\\boxed{4}, checked: \\boxed{4}", "4", "correct"),
    ("<think>maybe \\boxed{5}?</think>The answer is \\boxed{6}.", "6", "correct"),
    ("<think>it is \\boxed{6}</think>So \\boxed{5}.", "6", "wrong"),
    ("reasoning without the opening tag</think>\\boxed{9}", "9", "correct"),
    ("<think>I was thinking \\boxed{9} but ran out of", "9", "no_answer"),
    ("\\boxed{8}\n\nLet me know if you need anything else!", "8", "correct"),
    # Wrong answers.
    ("\\boxed{41}", "42", "wrong"),
    ("\\boxed{0.49}", "\\frac{1}{2}", "wrong"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", "wrong"),
    ("\\boxed{x-1}", "x+1", "wrong"),
    ("\\boxed{7}", "-7", "wrong"),
    ("\\boxed{[1,2]}", "(1,2]", "wrong"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", "wrong"),
    ("\\boxed{1.01}", "1", "wrong"),
    ("\\boxed{2^{11}}", "1024", "wrong"),
    ("\\boxed{\\pi}", "3.14", "wrong"),
    ("\\boxed{12}\\boxed{13}", "12", "wrong"),
    # No box: no answer, however right the text is.
    ("The answer is 42.", "42", "no_answer"),
    ("42", "42", "no_answer"),
    ("$\\frac{1}{2}$", "0.5", "no_answer"),
    ("", "42", "no_answer"),
    ("<think>42</think>", "42", "no_answer"),
    # A box with nothing math-verify can read.
    ("\\boxed{}", "42", "parse_error"),
]


@pytest.mark.parametrize(("completion", "reference", "reason"), MATH_PAIRS)
def test_math_verify_pairs(completion: str, reference: str, reason: Reason) -> None:
    verifier = make_verifier(MathSettings())
    assert verifier.verdict(completion, verifier.check_reference(reference)) == Verdict(reason == "correct", reason)


def test_there_are_at_least_fifty_math_pairs_of_each_outcome() -> None:
    reasons = [r for _, _, r in MATH_PAIRS]
    assert len(MATH_PAIRS) >= 50
    assert reasons.count("correct") >= 25 and reasons.count("wrong") >= 10 and reasons.count("no_answer") >= 5


def test_unboxed_answers_count_when_the_box_is_not_required() -> None:
    verifier = make_verifier(MathSettings(require_boxed=False))
    assert verifier.verdict("The final answer is 42.", "42") == Verdict(True, "correct")
    assert verifier.verdict("The final answer is $\\frac{1}{2}$", "0.5") == Verdict(True, "correct")
    assert verifier.verdict("The final answer is 41.", "42") == Verdict(False, "wrong")
    assert verifier.verdict("\\boxed{42} is it", "42") == Verdict(True, "correct")


@pytest.mark.parametrize("reference", ["", "   ", "\\frac{", "???", "\\boxed{"])
def test_math_references_that_do_not_parse_are_refused(reference: str) -> None:
    with pytest.raises(ValueError, match=r"empty reference|cannot parse the reference"):
        make_verifier(MathSettings()).check_reference(reference)


def test_strip_think() -> None:
    assert strip_think("<think>a</think> b") == " b"
    assert strip_think("a</think>b</think>c") == "c"
    assert strip_think("<think>cut") is None
    assert strip_think("plain") == "plain"


@pytest.mark.parametrize(
    ("settings", "completion", "reference", "reason"),
    [
        (ExactSettings(), "  Paris. ", "paris", "correct"),
        (ExactSettings(), "PARIS", "Paris", "correct"),
        (ExactSettings(), "<think>Lyon?</think>\n Paris", "Paris", "correct"),
        (ExactSettings(), "It is Paris", "Paris", "wrong"),
        (ExactSettings(), "   ", "Paris", "no_answer"),
        (ExactSettings(last_line=True), "Thinking about it.\nParis\n\n", "Paris", "correct"),
        (ExactSettings(last_line=True), "Paris\nno wait, Lyon", "Paris", "wrong"),
        (RegexSettings(pattern=r"Answer:\s*(\S+)"), "Answer: 12\nAnswer: 13", "13", "correct"),
        (RegexSettings(pattern=r"Answer:\s*(\S+)"), "answer: YES", "yes", "correct"),
        (RegexSettings(pattern=r"Answer:\s*(\S+)"), "Answer: 12", "13", "wrong"),
        (RegexSettings(pattern=r"Answer:\s*(\S+)"), "I think 13", "13", "no_answer"),
        (RegexSettings(pattern=r"Answer:\s*(\S+)", ignore_case=False), "answer: 13", "13", "no_answer"),
        (RegexSettings(pattern=r"\d+"), "12 then 14", "14", "correct"),
        (RegexSettings(), "The capital is Paris, France.", r"\bparis\b", "correct"),
        (RegexSettings(), "The capital is Parisian.", r"\bparis\b", "wrong"),
        (ChoiceSettings(), "The answer is (C).", "C", "correct"),
        (ChoiceSettings(), "Answer: b", "B", "correct"),
        (ChoiceSettings(), "\\boxed{D}", "D", "correct"),
        (ChoiceSettings(), "B.", "B", "correct"),
        (ChoiceSettings(), "<think>the answer is A</think>the answer is B", "B", "correct"),
        (ChoiceSettings(), "The answer is A", "B", "wrong"),
        (ChoiceSettings(), "\\boxed{E}", "B", "parse_error"),
        (ChoiceSettings(num_choices=5), "\\boxed{E}", "E", "correct"),
        (ChoiceSettings(), "I cannot decide between them", "B", "no_answer"),
    ],
)
def test_text_verifiers(
    settings: ExactSettings | RegexSettings | ChoiceSettings, completion: str, reference: str, reason: Reason
) -> None:
    verifier = make_verifier(settings)
    assert verifier.verdict(completion, verifier.check_reference(reference)) == Verdict(reason == "correct", reason)


def test_text_verifiers_refuse_unusable_references() -> None:
    with pytest.raises(ValueError, match="not one of the letters A, B, C, D"):
        make_verifier(ChoiceSettings()).check_reference("E")
    with pytest.raises(ValueError, match="not a valid regex"):
        make_verifier(RegexSettings()).check_reference("(unclosed")
    with pytest.raises(ValueError, match="empty reference"):
        make_verifier(ExactSettings()).check_reference(" ")
    with pytest.raises(ValueError, match="not a valid regex"):
        RegexSettings(pattern="[a-")
    assert make_verifier(ChoiceSettings()).check_reference(" (c) ") == "C"


def test_rewards_binary_and_signed() -> None:
    right, wrong, timeout = Verdict(True, "correct"), Verdict(False, "wrong"), Verdict(False, "timeout")
    assert [reward(v, "binary") for v in (right, wrong, timeout)] == [1.0, 0.0, 0.0]
    assert [reward(v, "signed") for v in (right, wrong, timeout)] == [1.0, -1.0, -1.0]


PLUGIN_MODULE = """
from asymptote.tasks.verifiers import Verdict


class Palindrome:
    def __init__(self, options):
        self.min_length = int(options.get("min_length", 1))

    def check_reference(self, reference):
        return reference

    def verdict(self, completion, reference):
        text = completion.strip()
        ok = len(text) >= self.min_length and text == text[::-1]
        return Verdict(ok, "correct" if ok else "wrong")


def make(options):
    return Palindrome(options)


def broken(options):
    return object()
"""


@pytest.fixture
def plugin_dist(tmp_path: Path) -> Iterator[Path]:
    """A distribution with verifier entry points, installed by putting its folder on sys.path."""
    (tmp_path / "palindrome_verifier.py").write_text(PLUGIN_MODULE)
    info = tmp_path / "palindrome_verifier-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: palindrome-verifier\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\npalindrome = palindrome_verifier:make\nbroken = palindrome_verifier:broken\n"
    )
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("palindrome_verifier", None)


@pytest.mark.usefixtures("plugin_dist")
def test_a_plugin_verifier_is_found_through_its_entry_point() -> None:
    assert {"broken", "palindrome"} <= set(plugin_names())
    verifier = make_verifier(PluginSettings(entry_point="palindrome", options={"min_length": 3}))
    assert verifier.verdict(" racecar ", "") == Verdict(True, "correct")
    assert verifier.verdict("aa", "") == Verdict(False, "wrong")
    assert verifier.verdict("abc", "") == Verdict(False, "wrong")
    with pytest.raises(TypeError, match="entry point 'broken' returned object, which lacks check_reference"):
        make_verifier(PluginSettings(entry_point="broken"))


def test_a_missing_plugin_is_named_with_the_installed_ones() -> None:
    with pytest.raises(ValueError, match=r"no verifier entry point 'chess' in group 'asymptote\.verifiers'"):
        make_verifier(PluginSettings(entry_point="chess"))
