"""Decode + accumulate of a whole bucket's P messages, table-driven: one check launch
per bucket plus one scatter launch per rank (per pass, see below), whatever the number
of segments.

Input: ``msg`` uint8 [P, row_bytes-strided] -- the P ranks' messages of one bucket in
the codec's wire format (``hvdsparse/codec.py``: header, 72-byte segment records,
8-aligned sections), rows starting at multiples of 8 bytes; ``out`` fp32, the flat
output that every layer's slice lives in (added to).

The bucket's layout (host-known, identical on every rank) is an int64 table
``tab[S, W]``, one row per segment in record order (columns ``T_*`` below): the layer's
element offset in ``out``, numel ``N``, capacity ``C``, index / value encodings, bin
size ``B``, quantisation bucket ``Q``, code bits, the byte offsets of the four sections
and of the record's count field, the bin-count width ``w`` and number of bins, the
segment's first row in the cumulative-count scratch, the binary-search depth and an
IMPLICIT segment's index address. A
block table maps each program of the scatter to ``(segment, first slot)``. The codec
builds both once per layout (:func:`build_table`, host ints only) and uploads them in
one host-to-device copy.

check (1 launch, grid ``(P, S)``): program ``(r, s)``

* header: ``(row_r[i] & mask[i]) != image[i]`` for any byte ``i`` of the header and
  records (``mask`` is 0 on the count fields) -> 16 (the whole row contributes nothing);
* ``c`` = the record's count (u32 read as int32): ``c < 0`` or ``c > C`` -> 2;
* BIN_U8 / BIN_U16 (with ``c`` in range): bin counts widened from ``w`` bytes (uint16
  read unsigned), ``bc[k] < 0`` or ``bc[k] > min(B, N - kB)`` or ``sum(bc) != c`` -> 4;
  else a relative index ``>= B`` in slots ``j < c``, or ``>= N - (nb-1) B`` in the last
  bin's slots ``[c - bc[nb-1], c)`` -> 1 (the same as ``bin * B + rel >= N``);
  the inclusive running sums of ``bc`` go to ``cum[r, bin0_s + k]``;
* IMPLICIT (with ``c`` in range): an index of the receiving rank's own int64
  ``implicit_indices`` (never sent; its device address is in the table) outside
  ``[0, N)`` in slots ``j < c`` -> 1;
* ``err[r, s]`` = (2 if the count is out of range, else the content code) | header;
  ``eff[r, s]`` = ``c`` if ``err == 0`` else 0 (a bad (rank, segment) adds nothing);
  ``flag[0] |= err`` (relaxed atomic); ``raw[r, s]`` = ``c`` as received (the cost
  model's figures: no extra launch to read them).

scatter (1 launch per rank ``r = 0 .. P-1`` and pass, in that order on the stream):
slot ``j < eff[r, s]`` of segment ``s`` has the element index ``j`` (DENSE), the int32
index (INT32), ``implicit_indices[j]`` (IMPLICIT), or ``bin(j) * B + rel[j]`` (BIN_*;
``bin(j)`` = the number of running sums ``<= j``, a binary search in ``cum[r]``); its
value is the fp32 / fp16 / bf16 value, ``fp32(fp32(q * scale[j // Q]) / (2^(b-1) - 1))``
of the b-bit code ``q + 2^(b-1)`` (``div_rn``), or ``+-scale`` by the sign bit; it is
added to ``out[off_s + index]`` with a relaxed ``tl.atomic_add``. An index outside
``[0, N)`` (INT32 only: other kinds were checked) is skipped and ORs 1 into the flag.

Bitwise determinism: every element receives its addends in rank order (launch order on
the stream). A layer's k-th segment is in pass k: passes run one after the other, each
with its P rank launches, so an element covered by two segments of the same layer
receives (segment, rank) addends in the order segment-major, rank-minor -- the order
of the per-segment decode (``ops.scatter_add_decode`` per segment, rows in rank
order). Inside one launch an element gets at most one addend from a valid message (a
row's indices are distinct; different layers own disjoint slices of ``out``). So the
sums equal the per-segment decode's bit for bit.

Error codes (the same values as ``hvdsparse.codec.ERROR_CODES``, repeated here because
kernels import nothing of hvdsparse): 1 index, 2 count, 4 bin counts, 16 header.
BITMASK segments are not handled here (the codec decodes buckets holding them per
segment). Offsets are int64.
"""
import numpy as np
import torch
import triton
import triton.language as tl

# columns of the segment table (int64)
(T_OUT, T_N, T_C, T_IENC, T_VENC, T_B, T_Q, T_BITS, T_OIND, T_OBC, T_OVAL, T_OSC, T_OCNT,
 T_W, T_NB, T_BIN0, T_STEPS, T_IMP) = range(18)
W = 18
#: index encodings (``payload.IndexEncoding``) and value encodings (``ValueEncoding``)
IE_DENSE, IE_INT32, IE_BIN_U8, IE_BIN_U16, IE_IMPLICIT = 0, 1, 2, 3, 4
VE_FP32, VE_FP16, VE_BF16, VE_INT8, VE_INT4, VE_INT2, VE_SIGN1 = range(7)
ERR_INDEX, ERR_COUNT, ERR_BIN_COUNTS, ERR_HEADER = 1, 2, 4, 16
SUPPORTED_INDEX = (IE_DENSE, IE_INT32, IE_BIN_U8, IE_BIN_U16, IE_IMPLICIT)
BLOCK = 1024


@triton.jit
def _bc_load(u8, i16, i32, byte_off, k, m, w):
    """Bin counts ``k`` (int64) of width ``w`` bytes at ``byte_off`` (uint16 unsigned)."""
    v1 = tl.load(u8 + byte_off + k, mask=m & (w == 1), other=0).to(tl.int64)
    v2 = tl.load(i16 + byte_off // 2 + k, mask=m & (w == 2), other=0).to(tl.int64) & 0xFFFF
    v4 = tl.load(i32 + byte_off // 4 + k, mask=m & (w == 4), other=0).to(tl.int64)
    return tl.where(w == 1, v1, tl.where(w == 2, v2, v4))


@triton.jit
def _check_kernel(u8, i16, i32, img, msk, tab, cum, eff, err, raw, flag, row_bytes, hdr_bytes,
                  S, nbins_total, W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    rowb = r * row_bytes
    offs = tl.arange(0, BLOCK).to(tl.int64)
    hd = tl.zeros([BLOCK], tl.int32)
    for b0 in range(0, hdr_bytes, BLOCK):
        o = b0 + offs
        m = o < hdr_bytes
        x = tl.load(u8 + rowb + o, mask=m, other=0)
        k = tl.load(msk + o, mask=m, other=0)
        e = tl.load(img + o, mask=m, other=0)
        hd = hd | ((x & k) != e).to(tl.int32)
    hdr = (tl.max(hd, axis=0) != 0).to(tl.int32) * 16
    t = tab + s * W
    N = tl.load(t + 1)
    C = tl.load(t + 2)
    ienc = tl.load(t + 3)
    B = tl.load(t + 5)
    oind = tl.load(t + 8)
    obc = tl.load(t + 9)
    ocnt = tl.load(t + 12)
    w = tl.load(t + 13)
    nb = tl.load(t + 14)
    bin0 = tl.load(t + 15)
    c = tl.load(i32 + (rowb + ocnt) // 4).to(tl.int64)
    c_bad = (c < 0) | (c > C)
    cc = tl.minimum(tl.maximum(c, 0), C)
    is_bin = (ienc == 2) | (ienc == 3)
    # bin counts: range, running sums, total
    nbl = tl.where(is_bin, nb, 0)
    bad = tl.zeros([BLOCK], tl.int32)
    carry = tl.zeros([1], tl.int64)
    cbase = cum + r * nbins_total + bin0
    for k0 in range(0, nbl, BLOCK):
        k = k0 + offs
        m = k < nbl
        v = _bc_load(u8, i16, i32, rowb + obc, k, m, w)
        lim = tl.minimum(B, N - k * B)
        bad = bad | (m & ((v < 0) | (v > lim))).to(tl.int32)
        cs = tl.cumsum(v, axis=0) + tl.sum(carry, axis=0)
        tl.store(cbase + k, cs.to(tl.int32), mask=m)
        carry = carry + tl.sum(v, axis=0)
    total = tl.sum(carry, axis=0)
    bc_bad = (tl.max(bad, axis=0) != 0) | (total != c)
    # relative indices of the used slots (meaningful only when the counts are valid)
    last = nb - 1
    bcl = tl.sum(_bc_load(u8, i16, i32, rowb + obc, last + offs,
                          (offs == 0) & is_bin & (nb > 0), w), axis=0)
    first = cc - bcl
    lastlim = N - last * B
    ncl = tl.where(is_bin, cc, 0)
    rb = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, ncl, BLOCK):
        j = j0 + offs
        m = j < ncl
        r8 = tl.load(u8 + rowb + oind + j, mask=m & (ienc == 2), other=0).to(tl.int64)
        r16 = tl.load(i16 + (rowb + oind) // 2 + j, mask=m & (ienc == 3),
                      other=0).to(tl.int64) & 0xFFFF
        rel = tl.where(ienc == 2, r8, r16)
        lim = tl.where(j >= first, lastlim, B)
        rb = rb | (m & (rel >= lim)).to(tl.int32)
    rel_bad = (tl.max(rb, axis=0) != 0) & (~bc_bad)
    content = tl.where(is_bin, bc_bad.to(tl.int32) * 4 | rel_bad.to(tl.int32), 0)
    # IMPLICIT: the template's own indices of the used slots must lie in [0, N)
    is_imp = ienc == 4
    imp = tl.load(t + 17).to(tl.pointer_type(tl.int64))
    nil = tl.where(is_imp, cc, 0)
    ib = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, nil, BLOCK):
        j = j0 + offs
        m = j < nil
        x = tl.load(imp + j, mask=m, other=0)
        ib = ib | (m & ((x < 0) | (x >= N))).to(tl.int32)
    content = tl.where(is_imp, (tl.max(ib, axis=0) != 0).to(tl.int32), content)
    e = tl.where(c_bad, 2, content) | hdr
    tl.store(err + r * S + s, e)
    tl.store(raw + r * S + s, c.to(tl.int32))
    tl.store(eff + r * S + s, tl.where(e == 0, c, 0).to(tl.int32))
    tl.atomic_or(flag, e, mask=e != 0, sem="relaxed")


@triton.jit(do_not_specialize=["r", "blk0"])
def _scatter_kernel(out, u8, i16, i32, f32, f16, bf16, tab, bseg, bj0, cum, eff, flag,
                    r, blk0, row_bytes, S, nbins_total,
                    W: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64) + blk0
    s = tl.load(bseg + pid)
    j0 = tl.load(bj0 + pid)
    rr = r.to(tl.int64)
    rowb = rr * row_bytes
    t = tab + s * W
    oout = tl.load(t + 0)
    N = tl.load(t + 1)
    ienc = tl.load(t + 3)
    venc = tl.load(t + 4)
    B = tl.load(t + 5)
    Q = tl.load(t + 6)
    bits = tl.load(t + 7)
    oind = tl.load(t + 8)
    oval = tl.load(t + 10)
    osc = tl.load(t + 11)
    nb = tl.load(t + 14)
    bin0 = tl.load(t + 15)
    steps = tl.load(t + 16)
    c = tl.load(eff + rr * S + s).to(tl.int64)
    j = j0 + tl.arange(0, BLOCK).to(tl.int64)
    m = j < c
    # ---- element index of every slot
    i32v = tl.load(i32 + (rowb + oind) // 4 + j, mask=m & (ienc == 1), other=0).to(tl.int64)
    r8 = tl.load(u8 + rowb + oind + j, mask=m & (ienc == 2), other=0).to(tl.int64)
    r16 = tl.load(i16 + (rowb + oind) // 2 + j, mask=m & (ienc == 3),
                  other=0).to(tl.int64) & 0xFFFF
    imp = tl.load(t + 17).to(tl.pointer_type(tl.int64))
    iim = tl.load(imp + j, mask=m & (ienc == 4), other=0)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + nb
    cbase = cum + rr * nbins_total + bin0
    for _ in range(0, steps):
        act = lo < hi
        mid = (lo + hi) // 2
        cv = tl.load(cbase + mid, mask=m & act, other=0).to(tl.int64)
        go = cv <= j
        lo = tl.where(act & go, mid + 1, lo)
        hi = tl.where(act & (~go), mid, hi)
    rel = tl.where(ienc == 2, r8, r16)
    idx = tl.where(ienc == 0, j, tl.where(ienc == 1, i32v, tl.where(ienc == 4, iim,
                                                                     lo * B + rel)))
    ok = (idx >= 0) & (idx < N)
    nbad = tl.sum((m & (~ok)).to(tl.int32), axis=0)
    tl.atomic_or(flag, 1, mask=nbad > 0, sem="relaxed")
    wm = m & ok
    # ---- value of every slot
    vf32 = tl.load(f32 + (rowb + oval) // 4 + j, mask=wm & (venc == 0), other=0.0)
    vf16 = tl.load(f16 + (rowb + oval) // 2 + j, mask=wm & (venc == 1),
                   other=0.0).to(tl.float32)
    vbf = tl.load(bf16 + (rowb + oval) // 2 + j, mask=wm & (venc == 2),
                  other=0.0).to(tl.float32)
    isq = (venc >= 3) & (venc <= 5)
    bq = tl.maximum(bits, 2)
    jb = j * bq
    byt = tl.load(u8 + rowb + oval + (jb >> 3), mask=wm & isq, other=0).to(tl.int64)
    code = (byt >> (jb & 7)) & ((1 << bq) - 1)
    q = (code - (1 << (bq - 1))).to(tl.float32)
    Qs = tl.maximum(Q, 1)
    sc = tl.load(f32 + (rowb + osc) // 4 + j // Qs, mask=wm & isq, other=0.0)
    sden = tl.zeros([BLOCK], tl.float32) + ((1 << (bq - 1)) - 1).to(tl.float32)
    vq = tl.math.div_rn(q * sc, sden)
    sbyte = tl.load(u8 + rowb + oval + (j >> 3), mask=wm & (venc == 6), other=0).to(tl.int64)
    ssc = tl.load(f32 + (rowb + osc) // 4 + tl.zeros([BLOCK], tl.int64),
                  mask=wm & (venc == 6), other=0.0)
    vs = tl.where(((sbyte >> (j & 7)) & 1) != 0, -ssc, ssc)
    v = tl.where(venc == 0, vf32, tl.where(venc == 1, vf16, tl.where(
        venc == 2, vbf, tl.where(isq, vq, vs))))
    tl.atomic_add(out + oout + idx, v, mask=wm, sem="relaxed")


# ------------------------------------------------------------------------ host side

def build_table(segs, block: int = BLOCK):
    """The layout's tables from host ints. ``segs``: one tuple per segment in record
    order, ``(out_offset, layer, numel, capacity, index_enc, value_enc, bin_size,
    quant_bucket, bits, (off_ind, off_bc, off_val, off_sc), count_byte_offset,
    bc_width, implicit_address)`` (the address of an IMPLICIT segment's int64 indices on
    the device, else 0). Returns ``(host int64 array, meta)``: the array holds ``tab[S, W]``,
    then ``bseg[nblk]``, then ``bj0[nblk]``; ``meta`` holds ``S``, ``nblk``, the total
    bins and per pass ``(first block, blocks)``."""
    S = len(segs)
    tab = np.zeros((S, W), dtype=np.int64)
    seen = {}
    passes = []                    # pass k -> list of segments
    bin0 = 0
    for s, (oo, layer, n, cap, ie, ve, bs, qb, bits, offs, ocnt, w, imp) in enumerate(segs):
        if ie not in SUPPORTED_INDEX:
            raise ValueError(f"bucket_decode: segment {s}: index encoding {ie} unsupported")
        nb = -(-n // bs) if ie in (IE_BIN_U8, IE_BIN_U16) and bs else 0
        tab[s] = (oo, n, cap, ie, ve, bs, qb, bits, offs[0], offs[1], offs[2], offs[3],
                  ocnt, w, nb, bin0, int(nb).bit_length(), imp)
        bin0 += nb
        k = seen.get(layer, 0)
        seen[layer] = k + 1
        while len(passes) <= k:
            passes.append([])
        passes[k].append(s)
    bseg, bj0, ranges = [], [], []
    for segs_k in passes:
        start = len(bseg)
        for s in segs_k:
            cap = int(tab[s, T_C])
            for j in range(0, cap, block):
                bseg.append(s)
                bj0.append(j)
        ranges.append((start, len(bseg) - start))
    host = np.concatenate([tab.reshape(-1), np.asarray(bseg, np.int64),
                           np.asarray(bj0, np.int64)])
    return host, dict(S=S, nblk=len(bseg), nbins=bin0, passes=tuple(ranges), block=block)


def decode(msg, out, table, meta, image, mask, hdr_bytes, flag, eff=None, err=None,
           cum=None, raw=None):
    """Check + scatter-add the P messages ``msg`` (uint8 [P, n]) into ``out`` (fp32,
    1-D). ``table``: the device int64 copy of :func:`build_table`'s array; ``image`` /
    ``mask``: uint8 [hdr_bytes] (the expected header + records with counts 0, and 0xFF
    except 0 on the count fields); ``flag``: int32 [>= 1]. Scratch (``eff``, ``err``
    int32 [P, S], ``cum`` int32 [P, nbins]) is made here unless passed, and so is
    ``raw`` (int32 [P, S]: every count field as received). Returns ``(eff, err, raw)``:
    per (rank, segment) the count used, the error code and the count received."""
    P = msg.shape[0]
    S, nblk, nbins, block = meta["S"], meta["nblk"], meta["nbins"], meta["block"]
    dev = msg.device
    if eff is None:
        eff = torch.empty((P, max(S, 1)), dtype=torch.int32, device=dev)
    if err is None:
        err = torch.empty((P, max(S, 1)), dtype=torch.int32, device=dev)
    if cum is None:
        cum = torch.empty((P, max(nbins, 1)), dtype=torch.int32, device=dev)
    if raw is None:
        raw = torch.empty((P, max(S, 1)), dtype=torch.int32, device=dev)
    if P == 0 or S == 0:
        return eff, err, raw
    tab = table[:S * W]
    bseg = table[S * W:S * W + nblk]
    bj0 = table[S * W + nblk:S * W + 2 * nblk]
    row_bytes = msg.stride(0)
    i16, i32 = msg.view(torch.int16), msg.view(torch.int32)
    f32, f16, bf16 = msg.view(torch.float32), msg.view(torch.float16), \
        msg.view(torch.bfloat16)
    _check_kernel[(P, S)](msg, i16, i32, image, mask, tab, cum, eff, err, raw, flag, row_bytes,
                          hdr_bytes, S, max(nbins, 1), W=W, BLOCK=block, num_warps=4)
    for start, n in meta["passes"]:
        if n == 0:
            continue
        for r in range(P):
            _scatter_kernel[(n,)](out, msg, i16, i32, f32, f16, bf16, tab, bseg, bj0, cum,
                                  eff, flag, r, start, row_bytes, S, max(nbins, 1),
                                  W=W, BLOCK=block, num_warps=4)
    return eff, err, raw
