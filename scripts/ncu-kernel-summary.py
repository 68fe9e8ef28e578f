"""Sums the kernel durations of an Nsight Compute CSV (`--metrics gpu__time_duration.sum --csv
--print-units base`, durations in ns): the total and the kernels by name, largest first.
Everything the CSV holds is summed: profile one step (`model_throughput --profile-decode`
takes one variant and one decode batch)."""
import collections
import csv
import re
import sys

lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = []
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    try:
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    except ValueError:
        sys.exit(f"kernel {r['ID']} ({r['Kernel Name'][:60]}): no duration ({r['Metric Value']!r})")
if not rows:
    sys.exit("no kernel durations in " + sys.argv[1])
print(f"kernels {len(rows)}  device total {sum(v for _, v in rows) / 1e6:.3f} ms")
by_name = collections.defaultdict(lambda: [0, 0.0])
for name, ns in rows:
    key = re.sub(r"[<(].*", "", name)[:70]
    by_name[key][0] += 1
    by_name[key][1] += ns
for key, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
    print(f"{ns / 1e6:8.3f} ms {count:5d}x {ns / count / 1e3:8.1f} us  {key}")
