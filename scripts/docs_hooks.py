"""MkDocs hooks (``hooks:`` in mkdocs.yml), run by every docs build.

- The configuration reference is generated from the config's pydantic models
  (``ray_ppo.config.reference.reference_markdown``) where docs/configuration.md holds its marker line
  (``MARKERS``), so it lists every key, type, default, bound and docstring of the code being
  built and cannot drift; so is docs/design.md's table of the package's modules, from their
  docstrings.
- benchmarks/README.md, benchmarks/real-models.md, benchmarks/streaming.md, their figures (benchmarks/*.png) and
  CHANGELOG.md join the site as pages of their own, read from where they live in the repository.
- Links keep working in both places: a page links to another file as the repository lays them out
  (docs/x.md to ``../benchmarks/README.md``, benchmarks/README.md to ``../docs/scaling.md``), and
  the build rewrites each such link to where the file lies in the site. Any other link is checked
  by MkDocs as it stands (a broken one fails the strict build).
"""

from __future__ import annotations

import ast
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

MARKERS = {"configuration.md": "<!-- config-reference -->", "design.md": "<!-- module-layout -->"}
"""Page -> the line that the generated Markdown replaces."""
ROOT = Path(__file__).resolve().parents[1]
DOCS = "docs"
OUTSIDE_DOCS = {"benchmarks/README.md": "benchmarks/README.md", "benchmarks/real-models.md": "benchmarks/real-models.md",
                "benchmarks/streaming.md": "benchmarks/streaming.md",
                **{f"benchmarks/{png.name}": f"benchmarks/{png.name}" for png in sorted((ROOT / "benchmarks").glob("*.png"))},
                "CHANGELOG.md": "changelog.md"}
"""Repository path of a file outside docs/ -> its path in the site (every figure in benchmarks/ too)."""
REPO_PATH = {site: repo for repo, site in OUTSIDE_DOCS.items()}
LINK = re.compile(r"(\]\()([^)\s#]+)([^)\s]*\))")


def on_files(files: Files, config) -> Files:
    for source, target in OUTSIDE_DOCS.items():
        files.append(File.generated(config, target, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    site_path = page.file.src_uri
    markdown = _site_links(markdown, site_path, REPO_PATH.get(site_path, f"{DOCS}/{site_path}"))
    marker = MARKERS.get(site_path)
    if marker is None:
        return markdown
    if marker not in markdown:
        raise PluginError(f"docs/{site_path} lost its {marker} line, where the generated part goes")
    return markdown.replace(marker, GENERATE[site_path]())


def config_reference() -> str:
    from ray_ppo.config.reference import reference_markdown

    return reference_markdown()


def module_layout() -> str:
    """A table of every module of the package and the first line of its docstring, read with
    ``ast`` (nothing is imported)."""
    rows = ["| module | what |", "|---|---|"]
    for path in sorted((ROOT / "ray_ppo").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if path.name == "__init__.py" and not doc:
            continue
        first = doc.strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{path.relative_to(ROOT).as_posix()}` | {first} |")
    return "\n".join(rows) + "\n"


GENERATE = {"configuration.md": config_reference, "design.md": module_layout}


def _site_links(markdown: str, site_path: str, repo_path: str) -> str:
    """Relative links of the page at ``repo_path`` in the repository, rewritten to the site's layout."""
    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repo = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), target))
        if in_repo in OUTSIDE_DOCS:
            in_site = OUTSIDE_DOCS[in_repo]
        elif in_repo.startswith(DOCS + "/"):
            in_site = in_repo[len(DOCS) + 1:]
        else:
            return match.group(0)
        relative = posixpath.relpath(in_site, posixpath.dirname(site_path) or ".")
        return f"{match.group(1)}{relative}{match.group(3)}"

    return LINK.sub(rewrite, markdown)
