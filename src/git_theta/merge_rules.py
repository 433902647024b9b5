"""Which merge strategy a tensor changed on both sides gets, without a keyboard.

In order (the first that names one wins): ``GIT_THETA_MERGE_STRATEGY`` (with
``GIT_THETA_MERGE_PARAMS``, ``k=v`` words), the work tree's rules file ``.theta-merges``
(lines ``TENSOR_GLOB STRATEGY [k=v ...]``, first match wins, ``#`` comments), git config
``theta.mergeStrategy`` (with ``theta.mergeParams``). A tensor none of them names goes to
the prompt when there is a terminal, else stays a conflict.

The rules file is committed, so it is hostile input: at most 1 MiB, a regular file, UTF-8;
every error is one line naming the file and line. Strategy names and params are checked
against the registry when the rules are read, before anything is merged.
"""

from __future__ import annotations

import fnmatch
import os

from git_theta.errors import ThetaError, UnknownPluginError, UsageError
from git_theta.merging import Choice, Rule

RULES_FILE = ".theta-merges"
RULES_CAP = 1 << 20
# Each tensor both sides changed is matched against every rule, and fnmatch's cost grows
# with a glob's length and its stars (a 0.8 MB glob took 0.15 s per tensor, 1,000 globs
# of 1 KB 0.46 s): real files are a few short lines, so all three are capped well below
# what takes time (1,000 rules of 16 stars: about 5 ms per tensor).
MAX_RULES = 1_000
MAX_GLOB = 256
MAX_STARS = 16
STRATEGY_ENV = "GIT_THETA_MERGE_STRATEGY"
PARAMS_ENV = "GIT_THETA_MERGE_PARAMS"
STRATEGY_CONFIG = "theta.mergeStrategy"
PARAMS_CONFIG = "theta.mergeParams"


def check_choice(strategy: str, words: list[str], where: str) -> Choice:
    """Return the strategy with its ``k=v`` params, checked against the registry.

    Raises UsageError (UnknownPluginError) starting with ``where`` for an unknown
    strategy, a word that is not ``k=v``, or a param the strategy refuses."""
    from git_theta.merges import MERGES
    from git_theta.merges._params import shown
    from git_theta.merges.base import parse_params

    try:
        plugin = MERGES.get(shown(strategy))  # a cut name is no plugin's either
    except UnknownPluginError as exc:
        raise UnknownPluginError(f"{where}: {exc}") from None
    params: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise UsageError(f"{where}: expected PARAM=VALUE, got {shown(word)!r}")
        if key in params:
            raise UsageError(f"{where}: {shown(key)} is given twice")
        params[key] = value
    try:
        parse_params(plugin, params)
    except ThetaError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return Choice(strategy, tuple(params.items()), where)


def parse_words(text: str) -> list[str]:
    """``k=v`` words separated by spaces or commas."""
    return text.replace(",", " ").split()


def parse_rules(text: str, source: str) -> list[tuple[str, Choice]]:
    """Parse a rules file; raises ThetaError naming the line of any bad entry."""
    rules: list[tuple[str, Choice]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        if not line.isprintable():
            raise UsageError(f"{where}: holds a control character; fix the file and retry")
        fields = line.split()
        if len(fields) < 2:
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise UsageError(
                f"{where}: expected 'TENSOR_GLOB STRATEGY [PARAM=VALUE ...]', got {shown!r}"
            )
        if len(rules) >= MAX_RULES:
            raise UsageError(f"{source}: more than {MAX_RULES:,} rules")
        if len(fields[0]) > MAX_GLOB or fields[0].count("*") > MAX_STARS:
            raise UsageError(
                f"{where}: the tensor glob is over {MAX_GLOB:,} characters or {MAX_STARS} "
                "stars; no tensor name needs that"
            )
        rules.append((fields[0], check_choice(fields[1], fields[2:], where)))
    return rules


def read_rules(top: str) -> list[tuple[str, Choice]]:
    """The rules of ``top``'s ``.theta-merges`` (none when it is absent)."""
    from git_theta.files import read_capped

    try:  # a regular file of at most RULES_CAP (a symlink to /dev/zero is refused)
        data = read_capped(os.path.join(top, RULES_FILE), RULES_CAP)
    except FileNotFoundError:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{RULES_FILE}: not UTF-8 text (byte {exc.start}); fix the file and retry"
        ) from None
    return parse_rules(text, RULES_FILE)


def from_env() -> Choice | None:
    """The strategy ``GIT_THETA_MERGE_STRATEGY`` forces for every tensor, if set."""
    strategy = os.environ.get(STRATEGY_ENV, "").strip()
    words = parse_words(os.environ.get(PARAMS_ENV, ""))
    if not strategy:
        if words:
            raise UsageError(f"{PARAMS_ENV} needs {STRATEGY_ENV} as well")
        return None
    return check_choice(strategy, words, STRATEGY_ENV)


def from_config(cwd: str | None = None) -> Choice | None:
    """The strategy of git config ``theta.mergeStrategy``, if set."""
    from git_theta import git

    strategy = (git.config_get(STRATEGY_CONFIG, cwd) or "").strip()
    words = parse_words(git.config_get(PARAMS_CONFIG, cwd) or "")
    if not strategy:
        if words:
            raise UsageError(f"git config {PARAMS_CONFIG} needs {STRATEGY_CONFIG} as well")
        return None
    return check_choice(strategy, words, f"git config {STRATEGY_CONFIG}")


def load_rule(top: str, forced: Choice | None = None) -> tuple[Rule, Choice | None]:
    """Return (tensor name -> configured choice or None, the file-wide choice if any).

    ``forced`` (a command line's ``--strategy``) wins over everything. Raises ThetaError
    for a bad setting or rules file, before anything is merged."""
    whole = forced or from_env()
    if whole is not None:
        chosen = whole
        return (lambda _name: chosen), whole
    rules = read_rules(top)
    fallback = from_config(top)

    def rule(name: str) -> Choice | None:
        for pattern, choice in rules:
            if fnmatch.fnmatchcase(name, pattern):
                return choice
        return fallback

    return rule, fallback
