"""MkDocs hook: serve the committed benchmark results (benchmarks/results/*.png, *.json) under results/.

The performance page shows the plots the benchmark scripts wrote; they stay where the
scripts write them, and no copy lives under docs/.
"""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def on_files(files, config):
    for path in sorted((ROOT / "benchmarks" / "results").glob("*")):
        if path.suffix in (".png", ".json"):
            files.append(
                File(
                    f"results/{path.name}",
                    src_dir=str(path.parent.parent),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files
