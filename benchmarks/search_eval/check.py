"""Validate catalogs.json and queries.json (stdlib only). Run: python check.py"""

import collections
import json
import pathlib
import re

HERE = pathlib.Path(__file__).parent


def main() -> None:
    cat = json.loads((HERE / "catalogs.json").read_text())
    qs = json.loads((HERE / "queries.json").read_text())
    servers = cat["servers"]
    assert len(servers) >= 25, f"only {len(servers)} servers"
    aliases = [s["alias"] for s in servers]
    assert len(aliases) == len(set(aliases)), "duplicate aliases"
    names: set[str] = set()
    for s in servers:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", s["alias"]), s["alias"]
        assert s.get("name") and s.get("source"), s["alias"]
        tnames = [t["name"] for t in s["tools"]]
        assert len(tnames) == len(set(tnames)), f"duplicate tool names in {s['alias']}"
        for t in s["tools"]:
            assert isinstance(t.get("description"), str), (s["alias"], t["name"])
            assert isinstance(t.get("inputSchema"), dict), (s["alias"], t["name"])
            names.add(f"{s['alias']}.{t['name']}")
    dev, held = qs["dev"], qs["held_out"]
    allq = dev + held
    assert len(allq) >= 300, f"only {len(allq)} queries"
    for q in allq:
        assert q["query"].strip() and q["expected"], q
        for e in q["expected"]:
            assert e in names, f"unknown tool {e!r} in query {q['query']!r}"
    dq = {q["query"].strip().lower() for q in dev}
    hq = {q["query"].strip().lower() for q in held}
    assert not (dq & hq), f"queries in both splits: {sorted(dq & hq)[:5]}"
    assert len(dq) == len(dev) and len(hq) == len(held), "duplicate query within a split"
    per: collections.Counter[str] = collections.Counter()
    for q in allq:
        for a in {e.split(".", 1)[0] for e in q["expected"]}:
            per[a] += 1
    few = [a for a in aliases if per[a] < 5]
    assert not few, f"servers with fewer than 5 queries: {few}"
    print(
        f"ok: {len(servers)} servers, {len(names)} tools, {len(allq)} queries "
        f"(dev {len(dev)}, held_out {len(held)}); min queries per server {min(per[a] for a in aliases)}"
    )


if __name__ == "__main__":
    main()
