"""Images come back as MCP image content: matplotlib figures (plt.show(), figures left
open), display(), runtime.show_image(), an image as the final value; capped in number
and size with a note; a result with images has no structuredContent. Plots run in the
"batteries" image that scripts/setup.sh builds with build-image (first runtime)."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
from mcp.client.session import ClientSession

import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import Image
from tests.conftest import Engine, bridge_client, bridge_env

pytestmark = pytest.mark.anyio
PNG = b"\x89PNG\r\n\x1a\n"
BATTERIES_IMAGE = os.environ.get("MCP_TEST_BATTERIES_IMAGE", "localhost/mcp-sandbox-python:batteries")


async def call(client: ClientSession, code: str) -> tuple[list[str], list[bytes], Any]:
    """The text blocks, the decoded PNG images and the structuredContent of one call."""
    result = await client.call_tool("run_python", {"code": code})
    texts = [block.text for block in result.content if block.type == "text"]
    images = [base64.b64decode(block.data) for block in result.content if block.type == "image"]
    assert all(block.mime_type == "image/png" for block in result.content if block.type == "image")
    return texts, images, result.structured_content


# GUIDE.md's plot example, verbatim (tests/test_guide.py checks the guide still shows it).
PLOT_EXAMPLE = """\
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [1, 4, 9])
plt.title("squares")
plt.show()
"""


@pytest.fixture
def plots(proxy_engine: Engine) -> Engine:
    return Engine(proxy_engine.name, BATTERIES_IMAGE)


async def test_plots_come_back_as_png_images_and_are_closed(plots: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(plots, state_dir)) as client:
        texts, images, structured = await call(
            client, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
        )
        assert len(images) == 1 and images[0].startswith(PNG) and len(images[0]) > 2000, texts
        assert structured is None and texts == []
        _, two, _ = await call(client, "plt.figure(); plt.plot([1]); plt.figure(); plt.bar([1], [2]); None")
        assert len(two) == 2 and all(image.startswith(PNG) for image in two) and two[0] != two[1]
        _, shown, _ = await call(client, "figure, axes = plt.subplots()\naxes.plot([3, 1])\nfigure")
        assert len(shown) == 1  # the final value, not again as an open figure
        texts, none, structured = await call(
            client, "import os\n(plt.get_fignums(), os.listdir('/workspace'), os.environ['MPLCONFIGDIR'])"
        )
        assert none == [] and structured is not None and texts == ["([], [], '/tmp/matplotlib')"], texts


async def test_the_guides_plot_example_gives_one_image(plots: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(plots, state_dir)) as client:
        texts, images, structured = await call(client, PLOT_EXAMPLE)
    assert texts == [] and structured is None and len(images) == 1 and images[0].startswith(PNG)


async def test_the_eleventh_image_is_dropped_with_a_note(plots: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(plots, state_dir, MCP_BRIDGE_MAX_IMAGES="10")) as client:
        texts, images, _ = await call(
            client, "import matplotlib.pyplot as plt\nfor n in range(11):\n    plt.figure(); plt.plot([n])"
        )
    assert len(images) == 10
    assert texts == [
        "[session] Image 11 was not returned: at most 10 images per call (MCP_BRIDGE_MAX_IMAGES)."
    ]


async def test_pil_images_and_figures_are_shown_by_display(plots: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(plots, state_dir)) as client:
        texts, images, _ = await call(
            client,
            "from PIL import Image\nimport matplotlib.pyplot as plt\n"
            "display(Image.new('RGB', (40, 30), 'red'), 'a note')\nfigure = plt.figure()\ndisplay(figure)",
        )
    assert len(images) == 2 and all(image.startswith(PNG) for image in images)
    assert texts == ["'a note'"]


async def test_display_and_show_image_work_without_matplotlib(engine: Engine, state_dir: Path) -> None:
    # The plain image has no matplotlib or PIL: ToolImage, bytes and files still show.
    pixel = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
    )
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_MAX_IMAGE_BYTES="1000")) as client:
        texts, images, _ = await call(
            client,
            "from mcp import runtime\npixel = %r\n"
            % pixel
            + "display(runtime.ToolImage(pixel, 'image/png'))\nruntime.show_image(pixel)\n"
            "open('/tmp/p.png', 'wb').write(pixel)\nruntime.show_image('/tmp/p.png')\n"
            "runtime.show_image(pixel * 100)\nruntime.ToolImage(pixel, 'image/png')",
        )
        assert images == [pixel] * 4
        assert texts == [
            "[session] Image 4 was not returned: 6800 bytes, over the 1000-byte cap "
            "(MCP_BRIDGE_MAX_IMAGE_BYTES); save it smaller (a lower dpi, a smaller figure) or to a file."
        ]
        refused, _, _ = await call(client, "runtime.show_image(b'not an image')")
        assert "show_image: not a PNG, JPEG, GIF or WebP image" in refused[0]


def test_the_host_drops_images_that_are_not_within_the_caps() -> None:
    config = bridge.BridgeConfig(max_images=2, max_image_bytes=10)
    good: Image = {"mime_type": "image/png", "data": base64.b64encode(b"12345").decode()}
    kept, notices = bridge.checked_images(
        [
            good,
            {"mime_type": "image/svg+xml", "data": good["data"]},
            {"mime_type": "image/png", "data": "not base64!"},
            {"mime_type": "image/png", "data": base64.b64encode(b"x" * 11).decode()},
            good,
            good,
        ],
        config,
    )
    assert kept == [("image/png", good["data"])] * 2
    assert notices == [
        "Image 2 was dropped: not a valid image within the caps.",
        "Image 3 was dropped: not a valid image within the caps.",
        "Image 4 was dropped: not a valid image within the caps.",
        "Image 6 was dropped: at most 2 images per call.",
    ]
