// Command ociimage packs a directory into a one-layer OCI image archive (an OCI image layout in
// a tar) that `ctr images import` loads, so the test cluster runs images built locally instead of
// pulled from a registry.
//
//	ociimage -dir ROOTFS -name nodeagent.local/busybox:1 -entrypoint /bin/sh,-c,... -o image.tar
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *platform         `json:"platform,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

type blob struct {
	desc descriptor
	data []byte
}

func newBlob(mediaType string, data []byte) blob {
	sum := sha256.Sum256(data)
	return blob{descriptor{MediaType: mediaType, Digest: "sha256:" + hex.EncodeToString(sum[:]), Size: int64(len(data))}, data}
}

// layer tars dir with fixed times and root ownership, so the same tree gives the same digest.
func layer(dir string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(path); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		hdr.ModTime, hdr.AccessTime, hdr.ChangeTime = time.Unix(0, 0), time.Time{}, time.Time{}
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = io.Copy(tw, f)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

func run() error {
	dir := flag.String("dir", "", "root file system of the image")
	name := flag.String("name", "", "image name, e.g. nodeagent.local/busybox:1")
	entry := flag.String("entrypoint", "", "comma-separated entrypoint")
	out := flag.String("o", "", "output archive")
	flag.Parse()
	if *dir == "" || *name == "" || *out == "" {
		return fmt.Errorf("-dir, -name and -o are required")
	}
	layerData, err := layer(*dir)
	if err != nil {
		return err
	}
	l := newBlob("application/vnd.oci.image.layer.v1.tar", layerData)
	var entrypoint []string
	if *entry != "" {
		entrypoint = strings.Split(*entry, ",")
	}
	cfg := newBlob("application/vnd.oci.image.config.v1+json", mustJSON(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config":       map[string]any{"Entrypoint": entrypoint, "Env": []string{"PATH=/bin:/usr/bin:/sbin:/usr/sbin"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{l.desc.Digest}},
	}))
	manifest := newBlob("application/vnd.oci.image.manifest.v1+json", mustJSON(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        cfg.desc,
		"layers":        []descriptor{l.desc},
	}))
	md := manifest.desc
	md.Platform = &platform{Architecture: runtime.GOARCH, OS: "linux"}
	tag := (*name)[strings.LastIndex(*name, ":")+1:]
	md.Annotations = map[string]string{"io.containerd.image.name": *name, "org.opencontainers.image.ref.name": tag}
	index := mustJSON(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []descriptor{md}})

	f, err := os.Create(*out)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	add := func(path string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: path, Mode: 0o644, Size: int64(len(data)), ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := add("index.json", index); err != nil {
		return err
	}
	for _, b := range []blob{l, cfg, manifest} {
		if err := add("blobs/sha256/"+strings.TrimPrefix(b.desc.Digest, "sha256:"), b.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		os.Exit(1)
	}
}
