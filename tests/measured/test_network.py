"""Network bandwidth: Sailor's fit evaluated by hand, the cap, measured points."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.measured.importers import write_db
from hetplan.measured.network import SailorFit, point_bandwidth
from hetplan.measured.profile_db import ProfileDB
from hetplan.measured.sailor import read_sailor_network


def test_sailor_formula_by_hand(sailor_db: ProfileDB) -> None:
    # network_gh96.json, intra, GH-96, 4 GPUs: [[-0.75177369, 26.46781337, 82.0621593], 2.5056e11]
    # Sailor: x = log2(bytes / 1e6), GB/s = c2 x^2 + c1 x + c0. At 64 MB, x = 6:
    # -0.75177369 * 36 + 26.46781337 * 6 + 82.0621593 = 213.80518668 GB/s
    bw = sailor_db.network_bandwidth("GH200-96GB", "intra", 4, 64e6)
    assert bw == pytest.approx(213.80518668e9, rel=1e-9)
    # inter, 1 GPU per node: -0.16570216 * 36 + 2.79431173 * 6 + 11.74409677 = 22.54468939
    bw = sailor_db.network_bandwidth("GH200-96GB", "inter", 1, 64e6)
    assert bw == pytest.approx(22.54468939e9, rel=1e-9)


def test_cap_at_the_measured_maximum_and_no_answer_where_the_fit_is_negative(
    sailor_db: ProfileDB,
) -> None:
    # 1 GB: x = log2(1000) = 9.966: the parabola gives ~271 GB/s, above the 250.6 measured
    assert sailor_db.network_bandwidth("GH200-96GB", "intra", 4, 1e9) == 250558342885.70334
    # 1 kB: x = -9.966: the parabola is negative there
    assert sailor_db.network_bandwidth("GH200-96GB", "intra", 4, 1e3) is None
    assert sailor_db.network_bandwidth("GH200-96GB", "intra", 8, 64e6) is None  # not measured
    assert sailor_db.network_bandwidth("A100-40GB", "inter", 1, 64e6) is None  # pairs left out


def test_sailor_tables_imported() -> None:
    from .conftest import NETWORK_JSON

    batch = read_sailor_network(NETWORK_JSON)
    got = {(f.device, f.scope, f.gpus) for f in batch.fits}
    assert got == {
        ("GH200-96GB", "intra", 2),
        ("GH200-96GB", "intra", 4),
        ("GH200-96GB", "inter", 1),
        ("GH200-96GB", "inter", 2),
        ("GH200-96GB", "inter", 4),
    }
    inter2 = next(f for f in batch.fits if (f.scope, f.gpus) == ("inter", 2))
    assert inter2.fit == SailorFit(-0.33458842, 5.65056678, 23.30372797, 45696046497.67462)


def test_measured_points_interpolate_in_log_size(tmp_path: Path) -> None:
    pts = [(1e6, 10e9), (4e6, 20e9)]
    assert point_bandwidth(pts, 2e6) == pytest.approx(15e9)  # halfway in log2(size)
    assert point_bandwidth(pts, 1e9) == 20e9  # saturates beyond the largest
    assert point_bandwidth(pts, 1e5) is None  # below the smallest: latency-bound, unknown
    csv = tmp_path / "net.csv"
    csv.write_text("gpu,scope,gpus,size_bytes,bytes_per_s\nA100-40,intra,2,1e6,1e10\n")
    from hetplan.measured.csv_import import read_network_csv

    db = write_db(tmp_path / "n.sqlite", read_network_csv(csv))
    db.put_network_point("A100-40GB", "intra", 2, 4e6, 2e10)
    assert db.network_bandwidth("A100-40GB", "intra", 2, 2e6) == pytest.approx(15e9)
    assert ProfileDB(tmp_path / "n.sqlite").network_bandwidth(
        "A100-40GB", "intra", 2, 2e6
    ) == pytest.approx(15e9)
