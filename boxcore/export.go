package boxcore

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Export and import: a box with its snapshots to one file (an Incus instance backup, gzip
// tarball) and back. The file is what the daemon's backup export writes; import reads it
// twice: once to judge it — every config and device of the instance and of each snapshot,
// in every copy of the config the tarball carries, by the clone boundary (OffBoundary) —
// before the daemon sees a byte of it, and once to stream a rewritten tarball to the
// daemon: new tags (origin import), the stack's profile, pool and NIC (with the new box's
// fixed port name), no volatile.* keys (so Incus makes new MAC addresses and ids).

// OriginImport is TagOrigin of an imported box.
const OriginImport = "import"

// exportBackupPrefix names the temporary backups export makes (deleted after, and expiring
// by themselves in case export dies first).
const exportBackupPrefix = "claudebox-export-"

// maxConfigFile bounds a backup.yaml/index.yaml import reads into memory.
const maxConfigFile = 16 << 20

// Export writes box b, with its snapshots, to w as an Incus backup tarball (gzip) and
// returns its size. The daemon's temporary backup is deleted afterwards, also when the
// stream fails.
func (bs *Boxes) Export(ctx context.Context, b *Box, w io.Writer) (int64, error) {
	if Minting(b.Instance.Config) {
		return 0, Usagef("export: %s is still being minted (or its mint died): export a finished box", b.Name)
	}
	name := exportBackupPrefix + randomToken()
	req := incus.BackupsPost{Name: name, ExpiresAt: time.Now().Add(6 * time.Hour), CompressionAlgorithm: "gzip"}
	// The backup is removed whatever happens, once nothing is still making it: the request
	// is sent detached from ctx (cut off mid-flight it may still make one), and an
	// interrupted wait is followed by a detached one.
	defer bs.deleteBackup(b.Name, name)
	pctx, pcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	id, err := bs.Client.StartCreateBackup(pctx, b.Name, req)
	pcancel()
	if err == nil && id != "" {
		if _, err = bs.Client.WaitOperation(ctx, id, nil); ctx.Err() != nil {
			wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Minute)
			_, _ = bs.Client.WaitOperation(wctx, id, nil)
			wcancel()
		}
	}
	if err := interruptedExport(ctx); err != nil {
		return 0, fmt.Errorf("export: %w", err)
	}
	if err != nil {
		return 0, fmt.Errorf("export: backing up %s: %w", b.Name, err)
	}
	n, err := bs.Client.ExportBackup(ctx, b.Name, name, w)
	if err := interruptedExport(ctx); err != nil {
		return n, fmt.Errorf("export: %w", err)
	}
	if err != nil {
		return n, fmt.Errorf("export: streaming %s: %w", b.Name, err)
	}
	return n, nil
}

// interruptedExport says an export (or import) was interrupted, when ctx has ended.
func interruptedExport(ctx context.Context) error {
	if ctx.Err() == nil {
		return nil
	}
	return fmt.Errorf("interrupted (%v); nothing was left behind", context.Cause(ctx))
}

// deleteBackup removes export's temporary backup, detached from the caller's context so an
// interrupt does not leave it behind (it would expire anyway).
func (bs *Boxes) deleteBackup(inst, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = bs.Client.DeleteBackup(ctx, inst, name)
}

// ExportFile exports box b to the file at path, whole or not at all: the tarball goes to a
// temporary file (mode 0600) beside it, which is renamed over path only once complete. An
// existing path is refused unless force.
func (bs *Boxes) ExportFile(ctx context.Context, b *Box, file string, force bool) (int64, error) {
	if st, err := os.Stat(file); err == nil {
		if st.IsDir() {
			return 0, Usagef("export: %s is a directory: name a file, e.g. %s", file, filepath.Join(file, b.Name+".tar.gz"))
		}
		if !force {
			return 0, Usagef("export: %s already exists: pass --force to replace it, or name another file", file)
		}
	}
	f, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".partial-")
	if err != nil {
		return 0, fmt.Errorf("export: %w", err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err := f.Chmod(0o600); err != nil {
		return 0, fmt.Errorf("export: %w", err)
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	n, err := bs.Export(ctx, b, bw)
	if err != nil {
		return n, err
	}
	if err := bw.Flush(); err != nil {
		return n, fmt.Errorf("export: writing %s: %w", file, err)
	}
	if err := f.Sync(); err != nil {
		return n, fmt.Errorf("export: writing %s: %w", file, err)
	}
	if err := f.Close(); err != nil {
		return n, fmt.Errorf("export: writing %s: %w", file, err)
	}
	if err := interruptedExport(ctx); err != nil {
		return n, fmt.Errorf("export: %w", err)
	}
	if err := os.Rename(tmp, file); err != nil {
		return n, fmt.Errorf("export: %w", err)
	}
	ok = true
	return n, nil
}

// ImportOptions are the choices of `import`.
type ImportOptions struct {
	// Name is the new box's name; "" for the name it was exported under.
	Name string
	// Config is extra instance config put on the box (tests' tags).
	Config map[string]string
	// Timings, when set, receives how long each part took.
	Timings *ImportTimings
	// AfterCheck, when set, runs between the file's judgement and its upload (tests change
	// the file there: the upload judges it again).
	AfterCheck func()
}

// ImportTimings splits an import's wall time.
type ImportTimings struct {
	Check  time.Duration // reading and judging the file (no daemon)
	Upload time.Duration // rewriting and streaming it, and the daemon's unpack
	Start  time.Duration // machine-id, start, port binding, first boot
}

// Import makes a box of an exported file. All or nothing: a file whose config or devices
// (the instance's or any snapshot's) are outside the boundary is refused before the daemon
// is asked anything; a name already taken is refused; a failed or interrupted import
// leaves no instance behind.
func (bs *Boxes) Import(ctx context.Context, file string, o ImportOptions) (*Box, error) {
	b, err := bs.importBox(ctx, file, o)
	return b, importErr(err)
}

func (bs *Boxes) importBox(ctx context.Context, file string, o ImportOptions) (*Box, error) {
	t0 := time.Now()
	x, err := readExport(file)
	if err != nil {
		return nil, err
	}
	s := bs.Stack
	if s.MaxDisk == 0 {
		s.MaxDisk, _ = bs.DiskCap(ctx)
	}
	if off := x.judge(s); len(off) > 0 {
		return nil, Usagef("import %s: the file carries what claudebox never puts on a box:\n  %s\nnothing was created", file, strings.Join(off, "\n  "))
	}
	name := o.Name
	if name == "" {
		name = x.name
	}
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	if o.Timings != nil {
		o.Timings.Check = time.Since(t0)
	}
	unlock, err := lockMint(bs.Client.Remote(), name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if _, _, err := bs.Client.Instance(ctx, name); err == nil {
		return nil, Usagef("import: an instance named %s already exists: pick another with --name", name)
	} else if !errors.Is(err, incus.ErrNotFound) {
		if ierr := interruptedExport(ctx); ierr != nil {
			return nil, fmt.Errorf("import: %w", ierr)
		}
		return nil, err
	}
	if err := bs.checkStack(ctx); err != nil {
		if ierr := interruptedExport(ctx); ierr != nil {
			return nil, fmt.Errorf("import: %w", ierr)
		}
		return nil, err
	}

	// On a cluster the box lands on this member: the archive was read here, and its port is
	// bound here.
	target, err := bs.placement(ctx, "", true)
	if err != nil {
		return nil, err
	}

	m := &minting{bs: bs, o: NewOptions{Name: name}, token: randomToken(), clone: true}
	rw := &exportRewrite{stack: bs.Stack, name: name, from: x.name, version: bs.Version, token: m.token, extra: o.Config, created: time.Now().UTC(), checked: x, judgeStack: s, target: target}
	m.o.FirstBoot = firstBootOf(x.config)
	if o.AfterCheck != nil {
		o.AfterCheck()
	}
	t1 := time.Now()
	if sent, err := bs.importTarball(ctx, file, rw); err != nil {
		if sent && ctx.Err() != nil {
			// The daemon had the whole file when the interrupt cut the request: it makes
			// the instance anyway, a moment later. Wait for that before removing it.
			bs.awaitImportOf(name)
		}
		return nil, m.importFailed(ctx, err)
	}
	if o.Timings != nil {
		o.Timings.Upload = time.Since(t1)
	}
	t2 := time.Now()
	if x.typ == "container" {
		// A new machine-id, and with it a new DHCP client id (the exported box may still
		// be running somewhere).
		if err := bs.resetMachineID(ctx, name); err != nil {
			return nil, m.fail(ctx, "preparing", err)
		}
	}
	// An imported box exposes nothing on this host until asked (the exported one's
	// exposures were its host's).
	if err := bs.setExposures(ctx, name, nil); err != nil {
		return nil, m.fail(ctx, "preparing", err)
	}
	bound, err := m.start(ctx, target)
	if err != nil {
		return nil, err
	}
	in, _, err := bs.Client.Instance(ctx, name)
	if err != nil {
		<-bound
		return nil, m.fail(ctx, "reading", err)
	}
	box := &Box{Name: name, Instance: in}
	if err := m.firstBoot(ctx, box, time.Now(), bound); err != nil {
		return nil, err
	}
	if err := m.finish(ctx); err != nil {
		return nil, err
	}
	delete(box.Instance.Config, tagMint)
	if o.Timings != nil {
		o.Timings.Start = time.Since(t2)
	}
	return box, nil
}

// importErr says an interrupted import in import's words (the mint steps it shares with
// new say "new").
func importErr(err error) error {
	var ie *InterruptedError
	if !errors.As(err, &ie) {
		return err
	}
	left := "nothing was left behind"
	if ie.Left {
		left = "the half-made box could not be removed: claudebox rm " + ie.Name + " --force"
	}
	return fmt.Errorf("import: interrupted (%w) while %s %s; %s", ie.Cause, ie.Stage, ie.Name, left)
}

// importFailed cleans up after a failed upload and says why.
func (m *minting) importFailed(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return m.fail(ctx, "importing", err)
	}
	m.bs.discard(m.o.Name, m.token)
	if errors.Is(err, incus.ErrConflict) || m.bs.heldByOther(m.o.Name, m.token) {
		return Usagef("import: an instance named %s already exists: pick another with --name", m.o.Name)
	}
	return fmt.Errorf("import: %w", err)
}

// importTarball streams the rewritten tarball to the daemon and waits for the import. Like
// create, the wait is cancelled (where the daemon allows) and awaited when ctx ends.
//
// sent reports that the whole file went to the daemon (whatever the error after that).
func (bs *Boxes) importTarball(ctx context.Context, file string, rw *exportRewrite) (sent bool, err error) {
	f, err := os.Open(file)
	if err != nil {
		return false, err
	}
	defer f.Close()
	pr, pw := io.Pipe()
	rerr := make(chan error, 1)
	go func() {
		err := rewriteExport(f, pw, rw)
		pw.CloseWithError(err)
		rerr <- err
	}()
	// The upload is cut off with ctx: the daemon then has no complete file and makes nothing.
	id, err := bs.Client.StartImportInstance(ctx, pr, rw.name, bs.Stack.Pool, rw.target)
	pr.CloseWithError(errors.New("import: upload finished"))
	werr := <-rerr
	if werr != nil && err != nil && ctx.Err() == nil {
		return false, fmt.Errorf("rewriting the file: %w", werr)
	}
	if err != nil || id == "" {
		return werr == nil, err
	}
	return true, bs.awaitOrCancel(ctx, id, nil)
}

// awaitImportOf waits (bounded) for the daemon's import of name that an interrupt cut the
// request of: until a running operation on the instance has ended, or the instance exists,
// or a few seconds without either (the daemon made nothing).
func (bs *Boxes) awaitImportOf(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res := "/1.0/instances/" + name
	for quiet := time.Now().Add(importSettle); time.Now().Before(quiet); time.Sleep(100 * time.Millisecond) {
		ops, err := bs.Client.RunningOperations(ctx)
		if err != nil {
			return
		}
		for _, op := range ops {
			if slices.Contains(op.Resources["instances"], res) {
				_, _ = bs.Client.WaitOperation(ctx, op.ID, nil)
				return
			}
		}
		if _, _, err := bs.Client.Instance(ctx, name); err == nil {
			return
		}
	}
}

// importSettle bounds the wait for an import the daemon may still start after the request
// was cut: it stores the upload before it starts the operation.
const importSettle = 3 * time.Second

// exportFile is what import learnt of a file in its first reading.
type exportFile struct {
	name      string            // the name it was exported under
	typ       string            // container | virtual-machine
	config    map[string]string // the instance's own config (index.yaml)
	snapshots []string
	docs      map[string]*yaml.Node // every config file, by path in the tarball
	entries   map[string]bool       // every entry's name
	problems  []string              // what is wrong with the tarball itself
}

const (
	indexPath     = "backup/index.yaml"
	containerYAML = "backup/container/backup.yaml"
)

// configPath reports whether a tarball entry is a config file import judges and rewrites:
// the index, the instance's backup.yaml and each snapshot's.
func configPath(name string) bool {
	if name == indexPath || name == containerYAML {
		return true
	}
	rest, ok := strings.CutPrefix(name, "backup/snapshots/")
	return ok && strings.Count(rest, "/") == 1 && strings.HasSuffix(rest, "/backup.yaml")
}

// allowedPath reports whether an entry is one an instance backup holds.
func allowedPath(name string) bool {
	switch {
	case name == "backup", name == indexPath, name == "backup/virtual-machine.img", name == "backup/snapshots", name == "backup/virtual-machine-snapshots":
		return true
	case name == "backup/container" || strings.HasPrefix(name, "backup/container/"):
		return true
	case strings.HasPrefix(name, "backup/snapshots/"):
		return true
	case strings.HasPrefix(name, "backup/virtual-machine-snapshots/") && strings.HasSuffix(name, ".img") && strings.Count(name, "/") == 2:
		return true
	}
	return false
}

// openTar opens a backup file as a tar stream, gzip-compressed or not.
func openTar(r io.Reader) (*tar.Reader, func(), error) {
	br := bufio.NewReaderSize(r, 1<<20)
	magic, _ := br.Peek(2)
	if len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, err
		}
		return tar.NewReader(zr), func() { zr.Close() }, nil
	}
	return tar.NewReader(br), func() {}, nil
}

// entryCheck judges a tarball's entries one by one, the same way in both readings: plain
// paths inside an instance backup, each once, nothing through a symlink, no hard link out,
// no device node, no optimized (driver-specific) blob, config files that are plain YAML.
type entryCheck struct {
	seen  map[string]bool
	links map[string]bool // symlinks: nothing may be unpacked through one
}

func newEntryCheck() *entryCheck {
	return &entryCheck{seen: map[string]bool{}, links: map[string]bool{}}
}

func badPath(p string) bool {
	return p == "" || path.Clean(p) != p || strings.HasPrefix(p, "/") || slices.Contains(strings.Split(p, "/"), "..")
}

// entry returns what is wrong with one entry (its name without a trailing slash).
func (ec *entryCheck) entry(hdr *tar.Header) []string {
	name := strings.TrimSuffix(hdr.Name, "/")
	if badPath(name) {
		return []string{fmt.Sprintf("entry %q: not a plain path inside the backup", hdr.Name)}
	}
	if !allowedPath(name) {
		return []string{fmt.Sprintf("entry %s: no part of an instance backup", name)}
	}
	var out []string
	if ec.seen[name] {
		out = append(out, fmt.Sprintf("entry %s: twice in the file", name))
	}
	ec.seen[name] = true
	for p := path.Dir(name); p != "." && p != "/"; p = path.Dir(p) {
		if ec.links[p] {
			out = append(out, fmt.Sprintf("entry %s: inside symlink %s", name, p))
			break
		}
	}
	switch hdr.Typeflag {
	case tar.TypeSymlink:
		ec.links[name] = true
	case tar.TypeLink:
		if l := hdr.Linkname; badPath(l) || !allowedPath(l) {
			out = append(out, fmt.Sprintf("entry %s: a hard link to %q, outside the backup", name, l))
		}
	case tar.TypeChar, tar.TypeBlock:
		out = append(out, fmt.Sprintf("entry %s: a device node", name))
	}
	if strings.HasSuffix(name, ".bin") && strings.Count(name, "/") == 1 {
		out = append(out, fmt.Sprintf("entry %s: an optimized (storage driver) backup, which claudebox cannot read", name))
	}
	if configPath(name) && (hdr.Typeflag != tar.TypeReg || hdr.Size > maxConfigFile) {
		out = append(out, fmt.Sprintf("entry %s: not a config file", name))
	}
	return out
}

// readConfig reads a config file as the daemon's decoder would take it: one YAML mapping,
// no key twice, no anchors, aliases or merge keys (what import reads node by node must mean
// what the daemon decodes).
func readConfig(name string, r io.Reader) (*yaml.Node, error) {
	var doc yaml.Node
	if err := yaml.NewDecoder(io.LimitReader(r, maxConfigFile)).Decode(&doc); err != nil {
		return nil, fmt.Errorf("entry %s: unreadable (%v)", name, err)
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("entry %s: not a YAML mapping", name)
	}
	var probe any
	if err := doc.Decode(&probe); err != nil {
		return nil, fmt.Errorf("entry %s: unreadable (%v)", name, err)
	}
	if plainYAML(&doc) != nil {
		return nil, fmt.Errorf("entry %s: uses YAML anchors, aliases or merge keys, which no export writes", name)
	}
	return &doc, nil
}

// readExport reads a whole export file: its entries' names and kinds, and its config files.
func readExport(file string) (*exportFile, error) {
	f, err := os.Open(file)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, Usagef("import: no file %s", file)
		}
		return nil, fmt.Errorf("import: %w", err)
	}
	defer f.Close()
	tr, done, err := openTar(f)
	if err != nil {
		return nil, Usagef("import %s: not an exported box (%v)", file, err)
	}
	defer done()
	x := &exportFile{docs: map[string]*yaml.Node{}}
	ec := newEntryCheck()
	x.entries = ec.seen
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, Usagef("import %s: not an exported box, or a damaged one (%v)", file, err)
		}
		bad := ec.entry(hdr)
		x.problems = append(x.problems, bad...)
		name := strings.TrimSuffix(hdr.Name, "/")
		if len(bad) > 0 || !configPath(name) {
			continue
		}
		doc, err := readConfig(name, tr)
		if err != nil {
			x.problems = append(x.problems, err.Error())
			continue
		}
		x.docs[name] = doc
	}
	idx, ok := x.docs[indexPath]
	if !ok {
		return nil, Usagef("import %s: not an exported box (no %s)", file, indexPath)
	}
	if _, ok := x.docs[containerYAML]; !ok {
		x.problems = append(x.problems, "no "+containerYAML)
	}
	var head struct {
		Name      string   `yaml:"name"`
		Type      string   `yaml:"type"`
		Optimized bool     `yaml:"optimized"`
		Snapshots []string `yaml:"snapshots"`
		Config    struct {
			Container struct {
				Config map[string]string `yaml:"config"`
			} `yaml:"container"`
		} `yaml:"config"`
	}
	if err := idx.Decode(&head); err != nil {
		return nil, Usagef("import %s: unreadable %s: %v", file, indexPath, err)
	}
	x.name, x.typ, x.snapshots, x.config = head.Name, head.Type, head.Snapshots, head.Config.Container.Config
	if x.typ == "" {
		x.typ = "container"
	}
	if x.typ != "container" && x.typ != "virtual-machine" {
		x.problems = append(x.problems, fmt.Sprintf("%s: type %q is no instance claudebox makes", indexPath, x.typ))
	}
	if head.Optimized {
		x.problems = append(x.problems, indexPath+": an optimized (storage driver) backup, which claudebox cannot read")
	}
	if ValidateName(x.name) != nil {
		x.problems = append(x.problems, fmt.Sprintf("%s: name %q is no box name", indexPath, x.name))
	}
	for _, sn := range x.snapshots {
		if !validSnapshotName(sn) {
			x.problems = append(x.problems, fmt.Sprintf("%s: snapshot name %q is no snapshot name", indexPath, sn))
		}
	}
	return x, nil
}

// validSnapshotName: a name Incus could have made, and safe as a path segment.
func validSnapshotName(n string) bool {
	if n == "" || n == "." || n == ".." || len(n) > 255 || strings.ContainsAny(n, "/\\") {
		return false
	}
	for _, r := range n {
		if r < 0x20 || r == 0x7f {
			return false
		}
	}
	return true
}

// exportedInstance is what import judges of the instance or of one snapshot.
type exportedInstance struct {
	Name      string                       `yaml:"name"`
	Type      string                       `yaml:"type"`
	Config    map[string]string            `yaml:"config"`
	Devices   map[string]map[string]string `yaml:"devices"`
	Stateful  bool                         `yaml:"stateful"`
	Ephemeral bool                         `yaml:"ephemeral"`
}

type exportedVolume struct {
	Config map[string]string `yaml:"config"`
}

// configRoot returns the mapping holding container/snapshots/volume in a config file: the
// index nests it under "config".
func configRoot(p string, doc *yaml.Node) *yaml.Node {
	root := doc.Content[0]
	if p == indexPath {
		return mapGet(root, "config")
	}
	return root
}

// judge lists what in the file is outside the boundary, or wrong with the file itself.
func (x *exportFile) judge(s Stack) []string {
	out := append([]string{}, x.problems...)
	for _, p := range sortedKeys(x.docs) {
		out = append(out, x.judgeDoc(p, x.docs[p], s)...)
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// judgeDoc judges one config file: the instance's and every snapshot's config and devices
// by the clone boundary, and the root volume's config.
func (x *exportFile) judgeDoc(p string, doc *yaml.Node, s Stack) []string {
	var out []string
	cr := configRoot(p, doc)
	if cr == nil || cr.Kind != yaml.MappingNode {
		return []string{p + ": no instance config"}
	}
	where := func(what string) string { return p + ": " + what + ": " }
	var inst exportedInstance
	if n := mapGet(cr, "container"); n == nil || n.Decode(&inst) != nil {
		out = append(out, where("the instance")+"no readable config")
	} else {
		out = append(out, prefixAll(where("the instance"), judgeInstance(inst, x.typ, s))...)
	}
	var snaps []exportedInstance
	names := []string{}
	if n := mapGet(cr, "snapshots"); n != nil && n.Decode(&snaps) != nil {
		out = append(out, where("snapshots")+"unreadable")
	}
	for _, sn := range snaps {
		names = append(names, sn.Name)
		if !validSnapshotName(sn.Name) {
			out = append(out, fmt.Sprintf("%ssnapshot name %q is no snapshot name", where("snapshots"), sn.Name))
		}
		out = append(out, prefixAll(where("snapshot "+sn.Name), judgeInstance(sn, "", s))...)
	}
	if (p == indexPath || p == containerYAML) && !sameSet(names, x.snapshots) {
		out = append(out, fmt.Sprintf("%s: snapshots %v, but the index lists %v", p, names, x.snapshots))
	}
	var vol exportedVolume
	if n := mapGet(cr, "volume"); n != nil && n.Decode(&vol) != nil {
		out = append(out, where("the volume")+"unreadable")
	}
	out = append(out, prefixAll(where("the volume"), judgeVolume(vol.Config, s))...)
	var vsnaps []exportedVolume
	if n := mapGet(cr, "volume_snapshots"); n != nil && n.Decode(&vsnaps) != nil {
		out = append(out, where("volume snapshots")+"unreadable")
	}
	for _, v := range vsnaps {
		out = append(out, prefixAll(where("a volume snapshot"), judgeVolume(v.Config, s))...)
	}
	return out
}

// judgeInstance judges one instance or snapshot by the clone boundary. A root disk on
// another pool and the eth0 claudebox gives a box on another stack are the box's own (the
// import puts them on this stack); everything else is judged as a clone source is.
func judgeInstance(in exportedInstance, typ string, s Stack) []string {
	var out []string
	if typ != "" && in.Type != "" && in.Type != typ {
		out = append(out, fmt.Sprintf("type %s, but the index says %s", in.Type, typ))
	}
	if in.Stateful {
		out = append(out, "stateful (a memory dump claudebox cannot judge)")
	}
	devices := map[string]map[string]string{}
	for name, d := range in.Devices {
		d = maps.Clone(d)
		if isRootDisk(d) {
			d["pool"] = s.Pool
		}
		if name == "eth0" && d["type"] == "nic" {
			other := s
			other.Network = d["network"]
			if IsBoxNIC(d, other, "") {
				d = BoxNIC(s, "")
				d["host_name"] = HostName(in.Name)
			}
		}
		devices[name] = d
	}
	return append(out, OffBoundary(in.Config, devices, s)...)
}

func isRootDisk(d map[string]string) bool {
	return d["type"] == "disk" && d["path"] == "/" && d["source"] == ""
}

// judgeVolume: the root volume's own config may carry its size (within the cap) and Incus's
// bookkeeping, nothing else.
func judgeVolume(cfg map[string]string, s Stack) []string {
	var out []string
	for k, v := range cfg {
		switch {
		case strings.HasPrefix(k, "volatile."):
		case k == "size":
			if why := offRootSize("root", v, s); why != "" {
				out = append(out, "volume "+why)
			}
		default:
			out = append(out, fmt.Sprintf("volume config %s=%s (claudebox never sets it)", k, short(v)))
		}
	}
	return out
}

func prefixAll(p string, l []string) []string {
	out := make([]string, len(l))
	for i, s := range l {
		out[i] = p + s
	}
	return out
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// exportRewrite is what import changes in every config file on the way to the daemon.
type exportRewrite struct {
	stack   Stack
	name    string // the new box
	from    string // the exported name
	version string
	token   string // the mint token (instance only)
	extra   map[string]string
	created time.Time
	// checked is the file as first read and judged; judgeStack the stack it was judged for.
	checked    *exportFile
	judgeStack Stack
	target     string // the cluster member to import on ("" standalone)
}

// config is an instance's (or snapshot's) config as imported: no volatile.* keys, the
// source's claudebox tags replaced by the import's, the host-sized container limits where
// the file has none.
func (rw *exportRewrite) config(cfg map[string]string, typ string, snapshot bool) map[string]string {
	out := map[string]string{}
	for k, v := range cfg {
		if strings.HasPrefix(k, "volatile.") || (strings.HasPrefix(k, TagKey) && k != TagTemplate && k != TagBake) {
			continue
		}
		out[k] = v
	}
	out[TagKey] = "1"
	out[TagCreated] = rw.created.Format(time.RFC3339)
	out[TagOrigin] = OriginImport
	out[TagFrom] = rw.from
	out[TagVersion] = rw.version
	maps.Copy(out, rw.extra)
	if !snapshot {
		out[tagMint] = rw.token
	}
	DefaultLimits().applyContainerKeys(typ, out, 0)
	return out
}

// devices puts the root disk on the stack's pool and gives the box the stack's eth0 with
// its own fixed port name.
func (rw *exportRewrite) devices(devs map[string]map[string]string) map[string]map[string]string {
	out := map[string]map[string]string{}
	for name, d := range devs {
		d = maps.Clone(d)
		if isRootDisk(d) {
			d["pool"] = rw.stack.Pool
		}
		out[name] = d
	}
	out["eth0"] = BoxNIC(rw.stack, rw.name)
	return out
}

// doc rewrites one config file in place.
func (rw *exportRewrite) doc(p string, doc *yaml.Node) error {
	root := doc.Content[0]
	if p == indexPath {
		if err := mapSet(root, "name", rw.name); err != nil {
			return err
		}
		if err := mapSet(root, "pool", rw.stack.Pool); err != nil {
			return err
		}
	}
	cr := configRoot(p, doc)
	if cr == nil {
		return fmt.Errorf("%s: no instance config", p)
	}
	typ := "container"
	if n := mapGet(cr, "container"); n != nil {
		var in exportedInstance
		if err := n.Decode(&in); err != nil {
			return err
		}
		if in.Type != "" {
			typ = in.Type
		}
		// The mint marker goes only where the daemon reads the instance from (the index
		// and backup/container/backup.yaml), not into a snapshot's own copy.
		if err := rw.instance(n, in, typ, p != indexPath && p != containerYAML); err != nil {
			return err
		}
		if err := mapSet(n, "name", rw.name); err != nil {
			return err
		}
	}
	if n := mapGet(cr, "snapshots"); n != nil && n.Kind == yaml.SequenceNode {
		for _, sn := range n.Content {
			var in exportedInstance
			if err := sn.Decode(&in); err != nil {
				return err
			}
			if err := rw.instance(sn, in, typ, true); err != nil {
				return err
			}
		}
	}
	if n := mapGet(cr, "volume"); n != nil && n.Kind == yaml.MappingNode {
		if err := mapSet(n, "name", rw.name); err != nil {
			return err
		}
		if err := rw.volume(n); err != nil {
			return err
		}
	}
	if n := mapGet(cr, "volume_snapshots"); n != nil && n.Kind == yaml.SequenceNode {
		for _, v := range n.Content {
			if err := rw.volume(v); err != nil {
				return err
			}
		}
	}
	return nil
}

func (rw *exportRewrite) instance(n *yaml.Node, in exportedInstance, typ string, snapshot bool) error {
	if err := mapSet(n, "config", rw.config(in.Config, typ, snapshot)); err != nil {
		return err
	}
	if err := mapSet(n, "devices", rw.devices(in.Devices)); err != nil {
		return err
	}
	if err := mapSet(n, "profiles", []string{rw.stack.Profile}); err != nil {
		return err
	}
	if err := mapSet(n, "ephemeral", false); err != nil {
		return err
	}
	// What Incus computes from config and profiles; the file's copy would only mislead.
	mapDel(n, "expanded_config")
	mapDel(n, "expanded_devices")
	return nil
}

func (rw *exportRewrite) volume(n *yaml.Node) error {
	var v exportedVolume
	if err := n.Decode(&v); err != nil {
		return err
	}
	cfg := map[string]string{}
	for k, val := range v.Config {
		if !strings.HasPrefix(k, "volatile.") {
			cfg[k] = val
		}
	}
	return mapSet(n, "config", cfg)
}

// rewriteExport copies an export tarball from r to w (uncompressed: the daemon reads plain
// tar), with every config file rewritten by rw. It checks every entry and judges every
// config file again as it goes, so a file changed after its first reading is cut off
// mid-stream (the daemon then has no whole upload and makes nothing).
func rewriteExport(r io.Reader, w io.Writer, rw *exportRewrite) error {
	tr, done, err := openTar(r)
	if err != nil {
		return err
	}
	defer done()
	bw := bufio.NewWriterSize(w, 1<<20)
	tw := tar.NewWriter(bw)
	ec := newEntryCheck()
	changed := func(what []string) error {
		return fmt.Errorf("the file changed after it was checked: %s", strings.Join(what, "; "))
	}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if bad := ec.entry(hdr); len(bad) > 0 {
			return changed(bad)
		}
		name := strings.TrimSuffix(hdr.Name, "/")
		if !configPath(name) {
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			if _, err := io.Copy(tw, tr); err != nil {
				return err
			}
			continue
		}
		doc, err := readConfig(name, tr)
		if err != nil {
			return changed([]string{err.Error()})
		}
		if off := rw.checked.judgeDoc(name, doc, rw.judgeStack); len(off) > 0 {
			return changed(off)
		}
		if name == indexPath && !rw.checked.sameHead(doc) {
			return changed([]string{indexPath + " says another name, type or snapshot list"})
		}
		if err := rw.doc(name, doc); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		var buf bytes.Buffer
		enc := yaml.NewEncoder(&buf)
		enc.SetIndent(2)
		if err := enc.Encode(doc); err != nil {
			return err
		}
		_ = enc.Close()
		hdr.Size = int64(buf.Len())
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if _, err := tw.Write(buf.Bytes()); err != nil {
			return err
		}
	}
	if len(ec.seen) != len(rw.checked.entries) {
		return changed([]string{fmt.Sprintf("%d entries, %d when checked", len(ec.seen), len(rw.checked.entries))})
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return bw.Flush()
}

// sameHead reports whether an index says what the checked one said.
func (x *exportFile) sameHead(idx *yaml.Node) bool {
	var h struct {
		Name      string   `yaml:"name"`
		Type      string   `yaml:"type"`
		Optimized bool     `yaml:"optimized"`
		Snapshots []string `yaml:"snapshots"`
	}
	if idx.Decode(&h) != nil {
		return false
	}
	if h.Type == "" {
		h.Type = "container"
	}
	return h.Name == x.name && h.Type == x.typ && !h.Optimized && slices.Equal(h.Snapshots, x.snapshots)
}

// plainYAML returns the first node that is an anchor, an alias or a merge key: what
// import reads node by node must mean what the daemon's decoder makes of it.
func plainYAML(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.AliasNode || n.Anchor != "" || n.Tag == "!!merge" {
		return n
	}
	for _, c := range n.Content {
		if bad := plainYAML(c); bad != nil {
			return bad
		}
	}
	return nil
}

// mapGet returns the value of key in a YAML mapping, or nil.
func mapGet(m *yaml.Node, key string) *yaml.Node {
	if m == nil || m.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == key {
			return m.Content[i+1]
		}
	}
	return nil
}

// mapSet sets key in a YAML mapping to v (encoded), adding it when missing.
func mapSet(m *yaml.Node, key string, v any) error {
	if m == nil || m.Kind != yaml.MappingNode {
		return fmt.Errorf("setting %s: not a mapping", key)
	}
	var val yaml.Node
	if err := val.Encode(v); err != nil {
		return err
	}
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == key {
			m.Content[i+1] = &val
			return nil
		}
	}
	m.Content = append(m.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: key}, &val)
	return nil
}

// mapDel removes key from a YAML mapping.
func mapDel(m *yaml.Node, key string) {
	if m == nil || m.Kind != yaml.MappingNode {
		return
	}
	for i := 0; i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value == key {
			m.Content = append(m.Content[:i], m.Content[i+2:]...)
			return
		}
	}
}
