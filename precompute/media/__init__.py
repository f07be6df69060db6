"""Media to encoder input, on CPU and without torch: frames chosen (``clips``), images and videos
decoded, cropped and resized (``decode``, ``sizing``), PNG metadata found (``png_chunks``), and the
one error every step raises for a bad source (``errors.MediaError``)."""
