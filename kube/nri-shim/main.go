// nri-shim: containerd's NRI events, forwarded to the nodeagent over its unix socket.
//
// It holds no state and decides nothing: each CreateContainer, StopContainer, RemoveContainer and
// Synchronize is sent as JSON (the pod's identity, QoS class and cgroup parent, the container's
// Linux resources, the pod's nodeagent.io/ annotations) to the agent's /v1/nri/ endpoints, and the
// agent's answer becomes the container's adjustment (cpuset cpus and mems, memory limit). A refusal
// fails the container's creation with the agent's reason; an agent that does not answer within
// -timeout fails it too, so the kubelet is never blocked for long. Shared (Burstable, BestEffort)
// containers follow the agent's shared pool: a guaranteed container's answer moves them off its
// CPUs at once, and a long poll of /v1/nri/updates applies every other change of the pool as
// unsolicited updates (the only thing the shim remembers is the pool it last applied).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

const annotationPrefix = "nodeagent.io/"

type podRef struct {
	UID          string            `json:"uid"`
	Namespace    string            `json:"namespace"`
	Name         string            `json:"name"`
	CgroupParent string            `json:"cgroup_parent"`
	Annotations  map[string]string `json:"annotations"`
}

type linuxResources struct {
	CPUShares   uint64 `json:"cpu_shares"`
	CPUQuota    int64  `json:"cpu_quota"`
	CPUPeriod   uint64 `json:"cpu_period"`
	MemoryLimit int64  `json:"memory_limit"`
}

type container struct {
	ID        string         `json:"id"`
	Name      string         `json:"name"`
	Pod       podRef         `json:"pod"`
	Resources linuxResources `json:"resources"`
	Devices   []linuxDevice  `json:"devices,omitempty"`
}

// linuxDevice: a device node of the container's spec (the kubelet's device plugins' and CDI's);
// the agent matches its number to the devices it manages, so that the slot holds them.
type linuxDevice struct {
	Path  string `json:"path"`
	Type  string `json:"type"`
	Major int64  `json:"major"`
	Minor int64  `json:"minor"`
}

type adjustment struct {
	ContainerID string `json:"container_id"`
	CPUSetCPUs  string `json:"cpuset_cpus"`
	CPUSetMems  string `json:"cpuset_mems"`
	MemoryLimit int64  `json:"memory_limit"`
	// Updates: other (shared) containers' new cpusets, when this container took CPUs from the
	// shared pool; returned with CreateContainer so they apply before it starts.
	Updates     []adjustment `json:"updates"`
	PoolVersion string       `json:"pool_version"`
}

type syncResult struct {
	Updates  []adjustment      `json:"updates"`
	Released []string          `json:"released"`
	Refused  map[string]string `json:"refused"`
}

// poolUpdates: GET /v1/nri/updates, the shared containers' cpusets for the pool named Version.
type poolUpdates struct {
	Version string       `json:"version"`
	Updates []adjustment `json:"updates"`
}

// pollWait: how long one GET /v1/nri/updates waits for the shared pool to change.
const pollWait = 20 * time.Second

type agentError struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

type plugin struct {
	client  *http.Client
	token   string
	timeout time.Duration
	// lost: a call found the agent unreachable. The agent has then missed events (a container
	// stopped meanwhile keeps its slot), so once it answers again the shim registers anew, and
	// containerd's Synchronize at registration brings the agent up to date.
	lost atomic.Bool
	// failOpen: an unreachable agent lets the container be created as the kubelet asked (a refusal
	// still fails it); the Synchronize after the agent is back places it.
	failOpen bool
	// version: the shared pool the runtime's shared containers were last told (pool_version);
	// "" after a start, so the first poll brings every shared container up to date.
	version atomic.Value
}

func (p *plugin) knownVersion() string {
	v, _ := p.version.Load().(string)
	return v
}

// unreachable: the agent did not answer (as opposed to answering with a refusal).
type unreachable struct{ err error }

func (u unreachable) Error() string { return u.err.Error() }
func (u unreachable) Unwrap() error { return u.err }

// call sends one request to the agent and decodes its JSON answer into out (nil: none expected).
func (p *plugin) call(ctx context.Context, method, path string, body, out any) error {
	return p.callWithin(ctx, p.timeout, method, path, body, out)
}

func (p *plugin) callWithin(parent context.Context, timeout time.Duration, method, path string, body, out any) error {
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	var reader io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return err
		}
		reader = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://nodeagent"+path, reader)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+p.token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := p.client.Do(req)
	if err != nil {
		// A call its caller gave up on (a registration ending cancels its long poll) says nothing
		// of the agent: marking it lost would make the next registration end itself, every second.
		if parent.Err() == nil {
			p.lost.Store(true)
		}
		return unreachable{fmt.Errorf("nodeagent did not answer %s %s: %w", method, path, err)}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return fmt.Errorf("nodeagent's answer to %s %s: %w", method, path, err)
	}
	if resp.StatusCode >= 300 {
		var e agentError
		if json.Unmarshal(data, &e) == nil && e.Error.Message != "" {
			return fmt.Errorf("nodeagent refused (%d %s): %s", resp.StatusCode, e.Error.Code, e.Error.Message)
		}
		return fmt.Errorf("nodeagent answered %s to %s %s", resp.Status, method, path)
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(data, out)
}

func describe(pod *api.PodSandbox, ctr *api.Container) container {
	c := container{ID: ctr.GetId(), Name: ctr.GetName()}
	if pod != nil {
		c.Pod = podRef{
			UID:          pod.GetUid(),
			Namespace:    pod.GetNamespace(),
			Name:         pod.GetName(),
			CgroupParent: pod.GetLinux().GetCgroupParent(),
			Annotations:  map[string]string{},
		}
		// Only the agent's own keys travel; the agent checks them (unknown ones are refused).
		for k, v := range pod.GetAnnotations() {
			if strings.HasPrefix(k, annotationPrefix) {
				c.Pod.Annotations[k] = v
			}
		}
	}
	if c.Pod.CgroupParent == "" {
		c.Pod.CgroupParent = ctr.GetLinux().GetCgroupsPath()
	}
	res := ctr.GetLinux().GetResources()
	if cpu := res.GetCpu(); cpu != nil {
		c.Resources.CPUShares = cpu.GetShares().GetValue()
		c.Resources.CPUQuota = cpu.GetQuota().GetValue()
		c.Resources.CPUPeriod = cpu.GetPeriod().GetValue()
	}
	c.Resources.MemoryLimit = res.GetMemory().GetLimit().GetValue()
	for _, d := range ctr.GetLinux().GetDevices() {
		c.Devices = append(c.Devices, linuxDevice{Path: d.GetPath(), Type: d.GetType(), Major: d.GetMajor(), Minor: d.GetMinor()})
	}
	return c
}

func (p *plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	var a adjustment
	if err := p.call(ctx, http.MethodPost, "/v1/nri/containers", describe(pod, ctr), &a); err != nil {
		var u unreachable
		if p.failOpen && errors.As(err, &u) {
			fmt.Fprintf(os.Stderr, "nri-shim: container %s created unplaced (-fail-open): %v\n", ctr.GetId(), err)
			return nil, nil, nil
		}
		return nil, nil, err
	}
	adj := &api.ContainerAdjustment{}
	if a.CPUSetCPUs != "" {
		adj.SetLinuxCPUSetCPUs(a.CPUSetCPUs)
	}
	if a.CPUSetMems != "" {
		adj.SetLinuxCPUSetMems(a.CPUSetMems)
	}
	if a.MemoryLimit > 0 {
		adj.SetLinuxMemoryLimit(a.MemoryLimit)
	}
	updates := containerUpdates(a.Updates)
	if len(updates) > 0 {
		p.version.Store(a.PoolVersion)
	}
	return adj, updates, nil
}

// containerUpdates: the agent's answers as NRI updates of cpuset and memory limit. An update of a
// container that ended meanwhile must not fail the event it comes with: IgnoreFailure.
func containerUpdates(list []adjustment) []*api.ContainerUpdate {
	var updates []*api.ContainerUpdate
	for _, a := range list {
		if a.CPUSetCPUs == "" && a.CPUSetMems == "" && a.MemoryLimit <= 0 {
			continue
		}
		u := &api.ContainerUpdate{IgnoreFailure: true}
		u.SetContainerId(a.ContainerID)
		if a.CPUSetCPUs != "" {
			u.SetLinuxCPUSetCPUs(a.CPUSetCPUs)
		}
		if a.CPUSetMems != "" {
			u.SetLinuxCPUSetMems(a.CPUSetMems)
		}
		if a.MemoryLimit > 0 {
			u.SetLinuxMemoryLimit(a.MemoryLimit)
		}
		updates = append(updates, u)
	}
	return updates
}

// updater is what the poll needs of the stub: unsolicited container updates.
type updater interface {
	UpdateContainers([]*api.ContainerUpdate) ([]*api.ContainerUpdate, error)
}

// follow keeps the shared containers on the agent's shared pool: it long-polls GET
// /v1/nri/updates with the version the runtime was last told and applies what comes back (a
// guaranteed slot made or released through the agent's REST API, or a container's slot released,
// moves the pool between NRI events). Until ctx ends.
func (p *plugin) follow(ctx context.Context, s updater) {
	for ctx.Err() == nil {
		if !p.pollOnce(ctx, s) {
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// pollOnce: one long poll and its updates applied; false when either failed (try again later).
func (p *plugin) pollOnce(ctx context.Context, s updater) bool {
	var r poolUpdates
	path := "/v1/nri/updates?version=" + url.QueryEscape(p.knownVersion()) +
		fmt.Sprintf("&wait=%d", int(pollWait/time.Second))
	if err := p.callWithin(ctx, pollWait+p.timeout, http.MethodGet, path, nil, &r); err != nil {
		if ctx.Err() == nil {
			fmt.Fprintf(os.Stderr, "nri-shim: polling the shared pool: %v\n", err)
		}
		return false
	}
	if updates := containerUpdates(r.Updates); len(updates) > 0 {
		failed, err := s.UpdateContainers(updates)
		if errors.Is(err, stub.ErrNoService) {
			return false // not registered yet: the registration's Synchronize comes first
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "nri-shim: moving %d shared containers to CPUs of pool %s: %v\n", len(updates), r.Version, err)
			return false
		}
		for _, f := range failed {
			fmt.Fprintf(os.Stderr, "nri-shim: container %s was not moved to pool %s (gone?)\n", f.GetContainerId(), r.Version)
		}
	}
	p.version.Store(r.Version)
	return true
}

func (p *plugin) release(ctx context.Context, ctr *api.Container) error {
	return p.call(ctx, http.MethodDelete, "/v1/nri/containers/"+url.PathEscape(ctr.GetId()), nil, nil)
}

func (p *plugin) StopContainer(ctx context.Context, _ *api.PodSandbox, ctr *api.Container) ([]*api.ContainerUpdate, error) {
	return nil, p.release(ctx, ctr)
}

func (p *plugin) RemoveContainer(ctx context.Context, _ *api.PodSandbox, ctr *api.Container) error {
	return p.release(ctx, ctr)
}

func (p *plugin) Synchronize(ctx context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	byID := map[string]*api.PodSandbox{}
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	list := []container{}
	for _, ctr := range ctrs {
		// A stopped container holds nothing: its slot (if any) is released by leaving it out.
		if ctr.GetState() == api.ContainerState_CONTAINER_STOPPED {
			continue
		}
		list = append(list, describe(byID[ctr.GetPodSandboxId()], ctr))
	}
	var r syncResult
	if err := p.call(ctx, http.MethodPost, "/v1/nri/synchronize", map[string]any{"containers": list}, &r); err != nil {
		return nil, err
	}
	for id, why := range r.Refused {
		fmt.Fprintf(os.Stderr, "nri-shim: container %s keeps running unplaced: %s\n", id, why)
	}
	return containerUpdates(r.Updates), nil
}

// ready: the agent answers /readyz (no token needed) with 200.
func (p *plugin) ready(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://nodeagent/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// watch ends the registration (cancel) once the agent answers again after it was lost.
func (p *plugin) watch(ctx context.Context, cancel context.CancelFunc) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if p.lost.Load() && p.ready(ctx) {
				p.lost.Store(false)
				fmt.Fprintln(os.Stderr, "nri-shim: the agent answers again: registering anew to synchronize it")
				cancel()
				return
			}
		}
	}
}

func main() {
	agentSocket := flag.String("agent-socket", "/run/nodeagent/api.sock", "the agent's API unix socket ([api] unix_socket)")
	tokenFile := flag.String("token-file", "/var/lib/nodeagent/token", "the agent's API token file")
	nriSocket := flag.String("nri-socket", "/var/run/nri/nri.sock", "containerd's NRI socket")
	name := flag.String("name", "nodeagent", "plugin name")
	idx := flag.String("idx", "10", "plugin index (its order among NRI plugins)")
	timeout := flag.Duration("timeout", 2*time.Second, "how long one call to the agent may take")
	failOpen := flag.Bool("fail-open", false, "create containers unplaced while the agent does not answer (a refusal still fails them)")
	flag.Parse()

	raw, err := os.ReadFile(*tokenFile)
	if err != nil {
		fmt.Fprintf(os.Stderr, "nri-shim: reading the agent's token: %v\n", err)
		os.Exit(1)
	}
	sock := *agentSocket
	p := &plugin{
		token:    strings.TrimSpace(string(raw)),
		timeout:  *timeout,
		failOpen: *failOpen,
		client: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
			MaxIdleConns: 4,
		}},
	}
	stop, _ := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	// One registration per turn: a lost agent that answers again, or containerd going away
	// (a restart), ends it; the next one gets containerd's Synchronize. Only a signal ends the shim.
	for stop.Err() == nil {
		s, err := stub.New(p, stub.WithPluginName(*name), stub.WithPluginIdx(*idx), stub.WithSocketPath(*nriSocket),
			stub.WithOnClose(func() {}))
		if err != nil {
			fmt.Fprintf(os.Stderr, "nri-shim: %v\n", err)
			os.Exit(1)
		}
		ctx, cancel := context.WithCancel(stop)
		go p.watch(ctx, cancel)
		// Every registration's Synchronize tells the runtime the pool anew; the poll starts over.
		p.version.Store("")
		go p.follow(ctx, s)
		err = s.Run(ctx)
		cancel()
		if err != nil && ctx.Err() == nil {
			fmt.Fprintf(os.Stderr, "nri-shim: %v; registering again in 1s\n", err)
			select {
			case <-stop.Done():
			case <-time.After(time.Second):
			}
		}
	}
}
