"""``meshnet token``: the operator issues, lists and revokes the join tokens nodes join with.

    meshnet token create --node-id ID [--model M] [--layers A-B] [--ttl 30d]
    meshnet token list
    meshnet token revoke TOKEN_ID

They call the tracker's admin API (``/v1/admin/tokens``) with the operator's
admin key, ``MESHNET_ADMIN_KEY`` (``--admin-key``), at ``MESHNET_TRACKER``
(``--tracker``, default ``http://127.0.0.1:8000``; the first of a list). The
tracker keeps the tokens in its store, so with several trackers on one Redis
any of them will do. ``create`` prints the token alone on standard output
(``export MESHNET_JOIN_TOKEN=$(meshnet token create --node-id gpu-1)``) and
what it binds on standard error; the token is shown this once.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any, Final

import httpx

DEFAULT_TRACKER: Final = "http://127.0.0.1:8000"
TIMEOUT_S: Final = 10.0
_DURATION: Final = re.compile(r"(?P<n>[0-9]+(?:\.[0-9]+)?)(?P<unit>[smhd]?)")
_UNITS: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``3600``, ``90s``, ``15m``, ``12h`` or ``30d`` in seconds; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or float(match["n"]) <= 0:
        raise ValueError(f"a duration is a positive number with an optional unit s, m, h or d, got {text!r}")
    return float(match["n"]) * _UNITS[match["unit"]]


def add_token_parser(sub: Any) -> None:
    """The ``token`` subcommand and its three actions."""
    token = sub.add_parser("token", help="issue, list and revoke the join tokens nodes join with (operator)",
                           description="Manage join tokens through the tracker's admin API "
                                       "(MESHNET_ADMIN_KEY).")
    token.add_argument("--tracker", default=None,
                       help=f"tracker base URL; env MESHNET_TRACKER (the first of a list), default {DEFAULT_TRACKER}")
    token.add_argument("--admin-key", default=None, help="the tracker's admin key; env MESHNET_ADMIN_KEY")
    actions = token.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="issue a token for one node id (printed once)")
    create.add_argument("--node-id", required=True, help="the node id the token binds")
    create.add_argument("--model", default=None, help="bind the model too (its name or folder's name)")
    create.add_argument("--layers", default=None, help="bind the layers too, A-B inclusive")
    create.add_argument("--ttl", default=None, help="expire after this long: 3600, 15m, 12h, 30d (default: never)")
    actions.add_parser("list", help="every token, without secrets")
    revoke = actions.add_parser("revoke", help="revoke a token: its node leaves every route now")
    revoke.add_argument("token_id", help="the token's id (see `meshnet token list`)")


def _tracker(args: argparse.Namespace) -> str:
    given = args.tracker or os.environ.get("MESHNET_TRACKER") or DEFAULT_TRACKER
    return given.split(",")[0].strip().rstrip("/")


def _fail(response: httpx.Response) -> int:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    print(f"meshnet token: the tracker answered {response.status_code}: {message}", file=sys.stderr)
    return 1


def _when(stamp: float | None) -> str:
    return "never" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def run_token(args: argparse.Namespace) -> int:
    """Carry out ``meshnet token ACTION``; the exit status."""
    admin_key = args.admin_key or os.environ.get("MESHNET_ADMIN_KEY", "")
    if not admin_key:
        print("meshnet token: give the tracker's admin key (--admin-key or MESHNET_ADMIN_KEY)", file=sys.stderr)
        return 2
    base = f"{_tracker(args)}/v1/admin/tokens"
    headers = {"Authorization": f"Bearer {admin_key}"}
    try:
        with httpx.Client(timeout=TIMEOUT_S, trust_env=False) as client:
            if args.action == "create":
                body: dict[str, Any] = {"node_id": args.node_id}
                if args.model:
                    body["model"] = args.model
                if args.layers:
                    body["layers"] = args.layers
                if args.ttl:
                    body["ttl_s"] = parse_duration(args.ttl)
                response = client.post(base, json=body, headers=headers)
                if response.status_code != 201:
                    return _fail(response)
                made = response.json()
                print(made["token"])
                print(f"join token {made['token_id']} for node {made['node_id']}"
                      f"{', model ' + made['model'] if made['model'] else ''}"
                      f"{', layers ' + made['layers'] if made['layers'] else ''}; expires {_when(made['expires_at'])}."
                      " Start the node with --join-token (MESHNET_JOIN_TOKEN); this is the only time it is shown.",
                      file=sys.stderr)
                return 0
            if args.action == "list":
                response = client.get(base, headers=headers)
                if response.status_code != 200:
                    return _fail(response)
                rows = response.json()["tokens"]
                print(f"{'TOKEN ID':<18} {'NODE':<24} {'STATE':<8} {'MODEL':<24} {'LAYERS':<8} EXPIRES")
                for row in rows:
                    print(f"{row['token_id']:<18} {row['node_id']:<24} {row['state']:<8} {row['model'] or '-':<24} "
                          f"{row['layers'] or '-':<8} {_when(row['expires_at'])}")
                return 0
            response = client.delete(f"{base}/{args.token_id}", headers=headers)
            if response.status_code != 200:
                return _fail(response)
            revoked = response.json()
            print(f"revoked join token {revoked['token_id']} of node {revoked['node_id']}"
                  f"{'; the node left every route' if revoked['evicted'] else ''}")
            return 0
    except ValueError as exc:
        print(f"meshnet token: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"meshnet token: cannot reach the tracker at {_tracker(args)}: {exc}", file=sys.stderr)
        return 1
