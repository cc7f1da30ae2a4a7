"""Text out of a message's content as OpenAI-style clients send it: null, a string, or a list
of parts of which text parts are read. Each route words the refusal in its own error shape."""

from __future__ import annotations

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
MEDIA_PARTS = frozenset({"image_url", "input_image", "input_audio", "file", "image", "audio"})


class ContentError(ValueError):
    """Content that is not text: `index` None when it is neither a string nor a list, else
    the part's index, and `media` the kind of a media part (which this model cannot read)."""

    def __init__(self, index: int | None, media: str | None = None):
        super().__init__(index, media)
        self.index, self.media = index, media


def text_of(content) -> str:
    """The content's text: "" for null, the string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ContentError(None)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ContentError(j, kind if kind in MEDIA_PARTS else None)
    return "".join(texts)
