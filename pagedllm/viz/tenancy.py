"""What one tenant may see of the visualizer's messages.

A tenant sees its own requests whole. Of everyone else's it sees block ownership and
counts (which blocks a sequence holds, how many tokens it has), never text, token ids or
request ids: the pool is shared, so its occupancy is visible anyway, but what others
send is not."""
from __future__ import annotations

EVERYTHING = object()   # the viewer of an admin key
_UNKNOWN = object()     # an owner the message does not name: shown to nobody


def view(msg: dict, viewer) -> dict:
    """msg as `viewer` (a tenant label, None on a keyless server, or EVERYTHING) may see it."""
    out = {k: v for k, v in msg.items() if not k.startswith("_")}
    if viewer is EVERYTHING:
        return out
    reqs: dict = msg.get("_req_owner", {})
    seqs: dict = msg.get("_seq_owner", {})

    def foreign_req(rid) -> bool:
        return reqs.get(rid, (_UNKNOWN,))[0] != viewer

    def anon(rid):
        return reqs.get(rid, (None, "request ?"))[1] if foreign_req(rid) else rid

    kind = msg.get("kind")
    if kind == "request" and foreign_req(msg["req"]):
        out.update(req=anon(msg["req"]), prompt=[""] * len(msg["prompt"]), hidden=True)
    elif kind == "abort":
        out["req"] = anon(msg["req"])
    elif kind == "step":
        out["tokens"] = {sid: [""] * len(p) if seqs.get(sid, _UNKNOWN) != viewer else p
                         for sid, p in msg["tokens"].items()}
    elif kind == "snapshot":
        out["seqs"] = {sid: {**e, "req": anon(e["req"]), "tokens": [""] * len(e["tokens"]), "hidden": True}
                       if foreign_req(e["req"]) else e for sid, e in msg["seqs"].items()}
        out["requests"] = {anon(rid): r for rid, r in msg["requests"].items()}
    return out
