"""What the tiers hold, as the restore planner's Holdings: plain data in (keepers' inventories, S3 manifests),
Holdings and where to fetch each one out. No Ray, no boto3."""

from __future__ import annotations

from orchestrator.state.restore_plan import TIERS, Holding


def keeper_holdings(inventory: dict[str, list[dict]], tiers=TIERS, step: int | None = None):
    """(Holdings, their sources, optimizer steps by step, unit shapes) from {node: the keeper's inventory rows}."""
    holdings, sources, opt, shapes = [], {}, {}, {}
    for node, rows in inventory.items():
        for row in rows:
            if row["tier"] not in tiers or (step is not None and row["step"] != step):
                continue
            holder = f"{row['tier']}:{node}:{row['rank']}"
            holdings.append(Holding(row["tier"], holder, node, row["unit"], tuple(tuple(r) for r in row["region"]),
                                    row["step"]))
            sources[(holder, row["step"])] = ("keeper", node, row["tier"], row["rank"])
            shapes[row["unit"]] = row["shape"]
            opt[row["step"]] = row["optimizer_steps"]
    return holdings, sources, opt, shapes


def process_holdings(held: list[dict]):
    """(Holdings, their sources, optimizer steps by step) from the state kept in worker processes (in-place
    recovery): per process {"rank" (its rank in the new plan, None: idle), "node", "handle", "rows"}. A process's
    own rank reads it in place (the restore planner's cost class 0)."""
    holdings, sources, opt = [], {}, {}
    for i, p in enumerate(held):
        holder = f"process:{p['node']}:{i}"
        for row in p["rows"]:
            holdings.append(Holding("live", holder, p["node"], row["unit"], tuple(tuple(r) for r in row["region"]),
                                    row["step"], p["rank"]))
            sources[(holder, row["step"])] = ("process", p["handle"], p["rank"])
            opt[row["step"]] = row["optimizer_steps"]
    return holdings, sources, opt


def s3_holdings(manifests: list[dict]):
    """(Holdings, their sources, optimizer steps by step) from complete S3 steps' manifests."""
    holdings, sources, opt = [], {}, {}
    for m in manifests:
        opt[m["step"]] = float(m["optimizer_steps"])
        for unit, u in m["units"].items():
            for piece in u["pieces"]:
                holdings.append(Holding("s3", piece["key"], None, unit, tuple(tuple(r) for r in piece["region"]),
                                        m["step"]))
                sources[(piece["key"], m["step"])] = ("s3", piece)
    return holdings, sources, opt
