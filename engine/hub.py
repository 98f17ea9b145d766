"""Models and data by Hugging Face Hub id, through the user's HF cache.

`model.path` and `reward.model` take a local directory or a Hub id, `org/name` with an optional
`@revision` (a branch, tag or commit). The driver downloads an id once (`fetch`: safetensors
weights, config and tokenizer files), before Ray starts, and hands the workers the snapshot's
local path, whose name holds the commit: a worker on a node without that path downloads the same
commit into its own cache (`local`), so every worker loads the same revision. Offline
(`HF_HUB_OFFLINE=1`) a cached id works and a missing one is one `HubError` line.

Invariants:
- a string that names an existing directory is a directory, never an id;
- nothing is downloaded for a directory, and a snapshot is returned only once it holds weights.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # weights, config, tokenizer
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)--([^/]+)/snapshots/([0-9a-f]{40})/?$")


class HubError(ValueError):
    """An id the Hub or the cache cannot give, in one line."""


def is_id(spec: str) -> bool:
    """Whether `spec` names a Hub repository (`org/name[@revision]`) rather than a local directory."""
    return bool(_ID.match(spec)) and not Path(spec).exists() and not spec.startswith((".", "~"))


def fetch(spec: str, what: str = "model", patterns: list[str] | None = None) -> str:
    """The local snapshot directory of Hub id `spec` (`org/name[@revision]`), downloaded into the HF
    cache if it is not there; `patterns` picks files (default: a model's weights, config, tokenizer)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, revision = spec.partition("@")
    kind = "dataset" if what == "dataset" else "model"
    try:
        path = snapshot_download(repo, repo_type=kind, revision=revision or None,
                                 allow_patterns=MODEL_FILES if patterns is None else patterns)
    except LocalEntryNotFoundError:
        raise HubError(f"{spec}: not in the Hugging Face cache, and the Hub cannot be reached (HF_HUB_OFFLINE "
                       "or no network): download it once where the Hub is reachable, or name a local directory") \
            from None
    except GatedRepoError:
        raise HubError(f"{spec}: a gated {kind}: accept its terms on huggingface.co and log in (hf auth login)") \
            from None
    except RepositoryNotFoundError:
        raise HubError(f"{spec}: no local directory, and no {kind} of that id on the Hub (or it is private: "
                       "hf auth login)") from None
    except RevisionNotFoundError:
        raise HubError(f"{spec}: the Hub has no revision {revision!r} of {repo}") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{spec}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    if kind == "model" and patterns is None and not any(Path(path).glob("*.safetensors")):
        raise HubError(f"{spec}: the repository has no safetensors weights, which rlflow loads")
    return path


def local(path: str) -> str:
    """A model directory on this node: `path` itself, or, for a Hub snapshot that another node
    downloaded (`.../models--org--name/snapshots/<commit>`), the same commit fetched here."""
    if Path(path).is_dir():
        return path
    found = _SNAPSHOT.search(path)
    if not found:
        return path  # not a snapshot: whoever opens it says what is missing
    kind, org, name, commit = found.groups()
    return fetch(f"{org}/{name}@{commit}", "dataset" if kind == "datasets" else "model")


def commit(path: str) -> str:
    """The commit of a snapshot directory `fetch` returned; "" for a local directory."""
    found = _SNAPSHOT.search(path)
    return found.group(4) if found else ""
