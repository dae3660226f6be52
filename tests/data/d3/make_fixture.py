"""Writes this folder's D3 fixture: ``d3_images/`` and ``d3_pkl/`` as D3's release extracts (docs/d3.md), two groups
and five images, small enough to read at a glance. The records have the fields of d-cube's ``doc.md`` ("Key
Concepts") and the shapes its ``d_cube/d3.py`` reads (``bbox`` a 1 x 4 array ``[[x, y, w, h]]``, ``segmentation`` a
list of RLE dicts, ``area`` a 1-element array). The texts, ids and pixels are made up.

    python tests/data/d3/make_fixture.py     (the committed files are its output)
"""

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).parent
W, H = 64, 48

GROUPS = {
    1: {"group_name": "outdoor dog", "scene": ["street"], "images": [10, 11, 12], "sents": [1, 2, 3]},
    2: {"group_name": "equestrian", "scene": ["sports"], "images": [20, 21], "sents": [4, 5]},
}
SENTS = {
    1: ("a dog not being held by a leash", True),
    2: ("a person walking a dog", False),
    3: ("a bicycle parked on the street", False),
    4: ("a horse running or jumping", False),
    5: ("equestrian rider's helmet", False),
}
# anno id: (image id, [x, y, w, h], sentence ids)
ANNOS = {
    100: (10, [4, 10, 20, 30], [1]),
    101: (10, [30, 2, 20, 40], [2]),
    102: (10, [40, 30, 24, 18], [1]),  # up to the image's right and bottom edges
    103: (11, [8, 6, 30, 40], [2]),
    104: (12, [50, 20, 20, 10], [3]),  # 6 px past the right edge: cut to the image
    105: (20, [2, 4, 50, 40], [4]),
    106: (20, [30, 1, 10, 8], [5]),
    107: (21, [10, 10, 40, 30], [4]),
}


def main() -> None:
    images, annotations, sentences, groups = {}, {}, {}, {}
    for gid, g in GROUPS.items():
        folder = g["group_name"].replace(" ", "_")
        groups[gid] = {
            "id": gid,
            "pos_sent_id": [s for s in g["sents"] if any(s in a[2] for a in ANNOS.values())],
            "inner_sent_id": g["sents"],
            "outer_sent_id": [],
            "img_id": g["images"],
            "scene": g["scene"],
            "group_name": g["group_name"],
            "group_name_zh": "",
        }
        for i, img_id in enumerate(g["images"]):
            name = f"{folder}/{i + 1:03d}_{img_id}.jpg"
            path = HERE / "d3_images" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (W, H), (40 * gid, 90 + 20 * i, 120)).save(path, quality=50)
            images[img_id] = {
                "id": img_id,
                "file_name": name,
                "height": H,
                "width": W,
                "flickr_url": "",
                "anno_id": [a for a, v in ANNOS.items() if v[0] == img_id],
                "group_id": gid,
                "license": "",
            }
    for aid, (img_id, (x, y, w, h), sids) in ANNOS.items():
        annotations[aid] = {
            "id": aid,
            "sent_id": sids,
            "segmentation": [{"size": [H, W], "counts": b"0`01O0000"}],
            "area": np.array([w * h], dtype=np.int64),
            "iscrowd": 0,
            "image_id": img_id,
            "bbox": np.array([[x, y, w, h]], dtype=np.float64),
            "group_id": images[img_id]["group_id"],
        }
    for sid, (text, negative) in SENTS.items():
        sentences[sid] = {
            "id": sid,
            "anno_id": [a for a, v in ANNOS.items() if sid in v[2]],
            "group_id": [g for g, v in GROUPS.items() if sid in v["sents"]],
            "is_negative": negative,
            "raw_sent": text,
            "raw_sent_zh": "",
        }
    (HERE / "d3_pkl").mkdir(exist_ok=True)
    for name, obj in (("images", images), ("annotations", annotations), ("sentences", sentences), ("groups", groups)):
        (HERE / "d3_pkl" / f"{name}.pkl").write_bytes(pickle.dumps(obj, protocol=4))


if __name__ == "__main__":
    main()
