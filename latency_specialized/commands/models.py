"""`latency-specialized models`: installed adapters, their scope and what they provide."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help="list installed model adapters with their scope")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def run(args: argparse.Namespace) -> int:
    from latency_specialized.plugins import get_registry

    reg = get_registry()
    rows = []
    for name in sorted(reg.adapters):
        a = reg.adapters[name]
        scope = a.scope()
        spec = a.spec("full")
        rows.append({
            "name": name, "provider": reg.providers[name], "description": a.description,
            "architectures": list(a.hf_architectures), "capabilities": sorted(a.capabilities),
            "layers": spec.num_layers, "hidden": spec.hidden_size,
            "scope": {"archs": list(scope.archs), "tp": list(scope.tp_sizes), "max_batch": scope.max_batch,
                      "dtypes": list(scope.dtypes), "spec_tokens": list(scope.spec_tokens)},
        })
    failures = [{"plugin": f.name, "error": f.error} for f in reg.failures]
    if args.json:
        print(json.dumps({"adapters": rows, "failed_plugins": failures, "blocked": reg.blocked}, indent=2))
        return 0
    for r in rows:
        s = r["scope"]
        print(f"{r['name']:<20} {r['description']}")
        print(f"{'':<20} provider={r['provider']} layers={r['layers']} hidden={r['hidden']} "
              f"provides={','.join(r['capabilities'])}")
        print(f"{'':<20} scope: archs={','.join(s['archs'])} tp={s['tp']} batch<=" f"{s['max_batch']} "
              f"dtypes={','.join(s['dtypes'])} spec_tokens={s['spec_tokens']}")
    for f in failures:
        print(f"FAILED plugin {f['plugin']}: {f['error']}")
    for b in reg.blocked:
        print(f"blocked plugin {b} (LATENCY_SPECIALIZED_BLOCK_PLUGINS)")
    return 0
