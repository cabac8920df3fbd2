"""report.json and report.html of a parity run (schema: eval/README.md, "report.json").

JSON is strict: non-finite floats are written as the strings "inf", "-inf" and "nan" (`float()` reads
them back); an identical pair has "psnr_db": "inf".
"""

import html
import json
import math
import statistics
from pathlib import Path

SCHEMA = "qwen-image-fusion/parity-report"
SCHEMA_VERSION = 1
METRIC_KEYS = ("psnr_db", "ssim", "lpips", "max_abs_diff", "mean_abs_diff")


def encode(value: object) -> object:
    """Replace non-finite floats (recursively) by their string names, for strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [encode(item) for item in value]
    return value


def decode_pair(pair: dict) -> dict:
    """A pair row read from JSON, with its metric strings ("inf") turned back into floats."""
    return {
        key: float(value) if key in METRIC_KEYS and isinstance(value, str) else value
        for key, value in pair.items()
    }


def write_json(data: dict, path: Path) -> None:
    path.write_text(
        json.dumps(encode(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8"
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def stats(values: list[float]) -> dict | None:
    """min / median / max, or None when there are no values."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(pairs: list[dict]) -> dict:
    """Counts, metric ranges and per-side generation times over all pairs."""
    metrics = {key: stats([p[key] for p in pairs if p[key] is not None]) for key in METRIC_KEYS}
    time = {}
    for slot in ("a", "b"):
        seconds = [p[slot]["seconds"] for p in pairs]
        time[slot] = {"median_s": statistics.median(seconds), "total_s": sum(seconds)}
    return {
        "pairs": len(pairs),
        "identical": sum(p["identical"] for p in pairs),
        "png_identical": sum(p["png_identical"] for p in pairs),
        "metrics": metrics,
        "time": time,
        "ran": {slot: what_ran([p[slot] for p in pairs]) for slot in ("a", "b")},
    }


def what_ran(sides: list[dict]) -> dict:
    """The approximate paths one side's runs took, as the workers' RunInfo recorded them: images decoded in
    the 2D form, why fast decodes fell back, and the steps its step cache skipped (per branch and image)."""
    decodes = [side["decode"] for side in sides if side.get("decode")]
    skipped = [c for side in sides if side.get("cache") for branch in side["cache"]["skipped"].values()
               for c in branch]  # fmt: skip
    return {
        "images": len(sides),
        "fast_decode": sum(decode["fast"] for decode in decodes),
        "decode_fallbacks": sorted({decode["fallback"] for decode in decodes if decode["fallback"]}),
        "cache_skipped": stats([float(count) for count in skipped]),
    }


def worst_first(pairs: list[dict]) -> list[dict]:
    """Differing pairs first, then by PSNR and SSIM ascending."""
    return sorted(pairs, key=lambda p: (p["identical"], p["psnr_db"], p["ssim"], p["index"]))


def number(value: float | int | None) -> str:
    """Six significant digits (SSIM near 1 keeps its informative digits); None is 'unavailable'."""
    return "unavailable" if value is None else f"{value:.6g}"


def summary_lines(report: dict) -> list[str]:
    """The human summary printed at the end of a run (and shown atop the HTML)."""
    summary, variants = report["summary"], report["variants"]
    lines = [f"pairs: {summary['pairs']}, identical: {summary['identical']}/{summary['pairs']}"]
    names = {"psnr_db": "PSNR dB", "ssim": "SSIM", "lpips": "LPIPS", "max_abs_diff": "max |diff|"}
    names["mean_abs_diff"] = "mean |diff|"
    for key, name in names.items():
        s = summary["metrics"][key]
        if key == "lpips" and not report["lpips"]["available"]:
            lines.append(f"LPIPS: unavailable ({report['lpips']['reason']})")
        elif s is not None:
            lines.append(
                f"{name} min/median/max: {number(s['min'])} / {number(s['median'])} / {number(s['max'])}"
            )
    for slot in ("a", "b"):
        t, spec = summary["time"][slot], variants[slot]["spec"]
        lines.append(f"time {slot} ({spec}): median {t['median_s']:.3f} s, total {t['total_s']:.3f} s")
        ran = summary["ran"][slot]
        if ran["fast_decode"] or ran["decode_fallbacks"]:
            fell = "".join(f"; fell back: {why}" for why in ran["decode_fallbacks"])
            lines.append(f"decode {slot}: 2D form in {ran['fast_decode']}/{ran['images']} images{fell}")
        if ran["cache_skipped"] is not None:
            k = ran["cache_skipped"]
            skipped = f"{k['min']:g} / {k['median']:g} / {k['max']:g}"
            lines.append(f"step cache {slot}: steps skipped min/median/max {skipped}")
    return lines


CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; font-size: 13px; }
th { background: #eee; }
img { width: 192px; image-rendering: pixelated; display: block; }
.differs { background: #fff0f0; }
.prompt { max-width: 22em; }
td:first-child { white-space: nowrap; }
li { white-space: pre-line; }
.cap { font-family: monospace; font-size: 11px; }
.pass { color: #070; font-weight: bold; } .fail { color: #a00; font-weight: bold; }
"""


def image_cell(path: str | None, caption: str) -> str:
    """A linked thumbnail with a caption below it, or just the caption."""
    text = html.escape(caption)
    if path is None:
        return f"<td>{text}</td>"
    src = html.escape(path, quote=True)
    return f'<td><a href="{src}"><img src="{src}" alt="{text}"></a><span class="cap">{text}</span></td>'


def input_images(paths: list[str]) -> str:
    """An edit pair's input image files, under its prompt."""
    if not paths:
        return ""
    return f'<span class="cap">images: {html.escape(", ".join(Path(p).name for p in paths))}</span>'


def pair_row(p: dict) -> str:
    diff_caption = "identical" if p["diff_image"] is None else f"diff x{p['diff_gain']:.1f}"
    cells = [
        f"<td>{p['id']}</td>",
        f'<td class="prompt">{html.escape(p["prompt"])}{input_images(p.get("images", []))}</td>',
        f"<td>{p['seed']}</td>",
        f"<td>{'yes' if p['identical'] else 'no'}</td>",
        *(f"<td>{number(p[key])}</td>" for key in METRIC_KEYS),
        f"<td>{p['a']['seconds']:.2f} / {p['b']['seconds']:.2f}</td>",
        image_cell(p["a"]["image"], f"pixels {p['a']['pixel_sha256'][:12]}"),
        image_cell(p["b"]["image"], f"pixels {p['b']['pixel_sha256'][:12]}"),
        image_cell(p["diff_image"], diff_caption),
    ]
    row_class = "" if p["identical"] else ' class="differs"'
    return f"<tr{row_class}>{''.join(cells)}</tr>"


def render_html(report: dict) -> str:
    """A standalone page: settings, summary, verdict, and the pairs worst-first with images and heatmaps."""
    variants, prompts, settings = report["variants"], report["prompts"], report["settings"]
    heads = ["pair", "prompt", "seed", "identical", "PSNR dB", "SSIM", "LPIPS", "max |diff|", "mean |diff|"]
    heads += ["seconds a / b", f"a: {variants['a']['spec']}", f"b: {variants['b']['spec']}", "amplified diff"]
    info = [
        f"model: a {report['model']['a']}, b {report['model']['b']}",
        f"prompts: {prompts['source']} ({prompts['count']}), seeds: {settings['seeds']}",
        f"size: {settings['width']}x{settings['height']}, steps: {settings['steps']}",
        *(
            f"{slot}: {variants[slot]['spec']} — {variants[slot]['workers'][0]['fusion_summary']}"
            for slot in "ab"
        ),
        *summary_lines(report),
    ]
    verdict = ""
    if report["expect"]["spec"] is not None:
        css = "pass" if report["expect"]["passed"] else "fail"
        verdict = f'<p class="{css}">{html.escape(report["expect"]["line"])}</p>'
    rows = "\n".join(pair_row(p) for p in worst_first(report["pairs"]))
    title = f"Parity: {variants['a']['spec']} vs {variants['b']['spec']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{CSS}</style></head>
<body><h1>{html.escape(title)}</h1>
<ul>{"".join(f"<li>{html.escape(line)}</li>" for line in info)}</ul>
{verdict}
<p>Pairs worst first. The diff column shows the per-pixel largest channel difference, amplified so the
largest difference of the pair is full intensity (gain shown).</p>
<table><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in heads)}</tr></thead>
<tbody>
{rows}
</tbody></table></body></html>
"""


def write_report(report: dict, out_dir: Path) -> None:
    write_json(report, out_dir / "report.json")
    (out_dir / "report.html").write_text(render_html(report), encoding="utf-8")
